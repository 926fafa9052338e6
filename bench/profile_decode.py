"""Where a decode step of a real shape spends its time (issue 4's profile), in four measurements:
  gemm     each projection GEMM alone (captured over >= 2 GB of weight copies, so L2 cannot serve repeats): GB/s
  replay   one captured decode step replayed back to back: the GPU's time per step, packed and unpacked q/k/v, gate/up
  engine   the engine's decode loop: wall time per step, and the same loop with replay() made a no-op (host alone)
  kernels  torch.profiler over eager decode steps: GPU time per kernel name, and the host's busiest functions
  offline  `brrr bench throughput`'s workload: a kernel table and a trace of 10 steady-state steps
    python bench/profile_decode.py --model llama-3.1-8b --out DIR [--sections gemm,engine,kernels,offline]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch.nn.functional as F

from brrr.analysis.hardware import measure
from brrr.analysis.model import decode_bytes_per_step
from brrr.bench.latency import run_batch
from brrr.bench.random_model import model_config, random_model
from brrr.bench.timing import graph_time_us, replay_time_us
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.models.llama import pack_projections


def emit(rec, f):
    print(json.dumps(rec), flush=True)
    f.write(json.dumps(rec) + "\n")


def gemm_bandwidth(cfg, f):
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q/o": (q, h), "k/v": (kv, h), "qkv packed": (q + 2 * kv, h), "gate/up": (i, h),
              "gate_up packed": (2 * i, h), "down": (h, i), "lm_head": (cfg.vocab_size, h)}
    for name, (n, k) in shapes.items():
        copies = max(2, int(2e9 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (1, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws], replays=10)
            emit({"section": "gemm", "shape": name, "n": n, "k": k, "m": m, "us": round(us, 2),
                  "gb_s": round(n * k * 2 / us / 1e3, 1)}, f)
        del ws
        torch.cuda.empty_cache()


def engine_section(model, cfg, packed: bool, gpu, f, prof_dir):
    engine = LLMEngine(model, None, EngineConfig(max_model_len=512, max_num_seqs=64, num_blocks=64 * 32 + 8,
                                                 pack_projections=packed))
    for b in (1, 8, 64):
        ms = replay_time_us(engine.runner.graph_for(b, 1)[0]) / 1e3  # short contexts
        floor = decode_bytes_per_step(cfg, b, 1, "bf16") / gpu.bandwidth * 1e3
        emit({"section": "replay", "packed": packed, "batch": b, "gpu_ms_per_step": round(ms, 4),
              "roofline_ms": round(floor, 4), "fraction": round(floor / ms, 3)}, f)
    run_batch(engine, 1, 5, 8, cfg.vocab_size, seed=99)
    ttft, decode_s = run_batch(engine, 1, 5, 200, cfg.vocab_size, seed=1)
    emit({"section": "engine", "packed": packed, "batch": 1, "wall_ms_per_step": round(decode_s / 199 * 1e3, 4),
          "tok_s": round(199 / decode_s, 1)}, f)
    # The host alone: the same loop with the GPU's step removed (replay a no-op, logits left as they were).
    runner = engine.runner
    real = [dict(table) for table in runner.graph_tables]
    noop = type("NoGraph", (), {"replay": lambda self: None})()
    for graphs in runner.graph_tables:
        for b, (g, logits, meta) in list(graphs.items()):
            graphs[b] = (noop, logits, meta)
    ttft, decode_s = run_batch(engine, 1, 5, 200, cfg.vocab_size, seed=2)
    emit({"section": "engine", "packed": packed, "batch": 1, "host_only_ms_per_step": round(decode_s / 199 * 1e3, 4)}, f)
    if packed:
        pr = cProfile.Profile()
        pr.enable()
        run_batch(engine, 1, 5, 200, cfg.vocab_size, seed=3)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        open(f"{prof_dir}/host_cprofile.txt", "w").write(s.getvalue())
    for table, graphs in zip(runner.graph_tables, real):
        table.update(graphs)
    if packed:  # a torch.profiler trace of real graph steps: GPU busy vs idle between steps
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run_batch(engine, 1, 5, 30, cfg.vocab_size, seed=4)
        p.export_chrome_trace(f"{prof_dir}/trace_graphs_bs1.json")
    del engine
    torch.cuda.empty_cache()


def kernel_section(model, cfg, prof_dir):
    from torch.profiler import ProfilerActivity, profile
    engine = LLMEngine(model, None, EngineConfig(max_model_len=512, max_num_seqs=8, num_blocks=300, cuda_graphs=False))
    run_batch(engine, 1, 5, 8, cfg.vocab_size, seed=99)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run_batch(engine, 1, 5, 21, cfg.vocab_size, seed=5)  # 20 eager decode steps (and one prefill)
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    open(f"{prof_dir}/kernels_eager_bs1.txt", "w").write(table)
    open(f"{prof_dir}/host_ops_eager_bs1.txt", "w").write(
        p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    del engine


def offline_section(model_name, f, prof_dir, num_requests=256):
    import random
    from torch.profiler import ProfilerActivity, profile

    from brrr.engine import SamplingParams
    cfg = model_config(model_name)
    engine = LLMEngine(random_model(cfg, torch.bfloat16, "cuda"), None,
                       EngineConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=2056))
    engine.stream_outputs = False
    rng = random.Random(0)
    engine.add_request("warm", [1] * 64, SamplingParams(max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(num_requests):
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(100, 1024))]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0.6,
                                                          ignore_eos=True, seed=i))
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        if steps == 300:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    engine.step()
            open(f"{prof_dir}/offline_kernels_{model_name}.txt", "w").write(
                p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
            open(f"{prof_dir}/offline_host_{model_name}.txt", "w").write(
                p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
            p.export_chrome_trace(f"{prof_dir}/offline_trace_{model_name}.json")
            steps += 10
        engine.step()
        steps += 1
    emit({"section": "offline", "model": model_name, "steps": steps, "wall_s": round(time.perf_counter() - start, 3)}, f)
    del engine
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="gemm,engine,kernels,offline")
    ap.add_argument("--offline-models", default="qwen3-0.6b")
    args = ap.parse_args()
    import os
    os.makedirs(args.out, exist_ok=True)
    sections = args.sections.split(",")
    cfg = model_config(args.model)
    gpu = measure()
    with open(f"{args.out}/profile.jsonl", "a") as f:
        emit({"section": "machine", "name": gpu.name, "bandwidth": round(gpu.bandwidth), "model": args.model}, f)
        if "gemm" in sections:
            gemm_bandwidth(cfg, f)
        model = random_model(cfg, torch.bfloat16, "cuda") if {"engine", "kernels"} & set(sections) else None
        if "engine" in sections:
            t = time.perf_counter()
            engine_section(model, cfg, False, gpu, f, args.out)
            pack_projections(model)
            engine_section(model, cfg, True, gpu, f, args.out)
            emit({"section": "timing", "engine_sections_s": round(time.perf_counter() - t, 1)}, f)
        if "kernels" in sections:
            kernel_section(model, cfg, args.out)
        del model
        torch.cuda.empty_cache()
        for name in args.offline_models.split(","):
            if "offline" in sections:
                offline_section(name, f, args.out)


if __name__ == "__main__":
    main()
