"""Where the engine's decode step spends the time its graph replay does not: per step, CUDA events around the
graph replay inside the engine (graph time) and from one replay's start to the next (cycle time), the host's
time in engine.step, against the same graph replayed back to back after the run (each replay timed alone).

With --contexts, the batch-1 graph is captured again for each --attn setting of the decode attention kernel
(stages, warps, release point, PDL) and timed with its sequence set to each context. With --engine-ab, the engine's
decode rate under the default and each named setting, alternating (a graph timed out of the engine can sit ~3% off).

    PYTHONPATH=$PWD python bench/engine_step_gap.py --contexts 8 40 100 204 --attn pdl parts --out F.jsonl
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import statistics
import time

import torch

from brrr.bench.latency import emit, run_batch
from brrr.bench.timing import replay_time_us
from brrr.kernels import graph_inputs


class TimedGraph:
    """A captured graph whose every replay records a CUDA event pair (no synchronisation)."""

    def __init__(self, graph):
        self.graph, self.events = graph, []

    def replay(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))

    def times_us(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in self.events]


def _summary(values: list[float]) -> dict:
    """First, middle and last tenth of a series, and its median."""
    n = max(1, len(values) // 10)
    return {"first": round(statistics.median(values[:n]), 1), "middle": round(statistics.median(
        values[len(values) // 2 - n // 2: len(values) // 2 + n - n // 2]), 1),
        "last": round(statistics.median(values[-n:]), 1), "median": round(statistics.median(values), 1)}


def between_graphs(trace: dict) -> dict:
    """From a Chrome trace of engine steps: the GPU work between two decode graph replays, op by op. A replay's
    kernels share the correlation id of its cudaGraphLaunch; between two replays, each op that starts after the
    first one's end (work overlapping a replay is hidden) with its gap after the previous end and its duration,
    medians over the steps; and the median time from one replay's end to the next one's start."""
    events = trace["traceEvents"]
    launches = {e["args"]["correlation"] for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                and e["name"] == "cudaGraphLaunch"}
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    spans = {}
    for e in gpu:
        c = e["args"].get("correlation")
        if c in launches:
            first, last = spans.get(c, (e["ts"], e["ts"] + e["dur"]))
            spans[c] = (min(first, e["ts"]), max(last, e["ts"] + e["dur"]))
    replays = sorted(spans.values())
    outside = sorted((e for e in gpu if e["args"].get("correlation") not in launches), key=lambda e: e["ts"])
    steps = []
    for (_, end), (start, _) in zip(replays, replays[1:]):
        ops, prev = [], end
        for e in outside:
            if end <= e["ts"] < start:
                ops.append((e["name"][:60], e["ts"] - prev, e["dur"]))
                prev = max(prev, e["ts"] + e["dur"])
        steps.append((ops, start - end))
    names = [tuple(n for n, _, _ in o) for o, _ in steps]
    common = max(set(names), key=names.count)
    same = [(o, gap) for (o, gap), n in zip(steps, names) if n == common]
    return {"steps": len(same), "of": len(steps), "outside_graphs_us": round(statistics.median(g for _, g in same), 2),
            "ops": [[name, round(statistics.median(o[i][1] for o, _ in same), 2),
                     round(statistics.median(o[i][2] for o, _ in same), 2)] for i, name in enumerate(common)]}


def profile(engine, cfg, new_tokens: int) -> dict:
    runner = engine.runner
    timed = {}
    for table in runner.graph_tables:
        for g, (graph, logits, meta) in table.items():
            timed[id(graph)] = TimedGraph(graph)
            table[g] = (timed[id(graph)], logits, meta)
    from brrr.engine import SamplingParams
    engine.add_request("gap", torch.randint(0, cfg.vocab_size, (5,)).tolist(),
                       SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    host, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        engine.step()
        host.append((time.perf_counter() - s) * 1e6)
    wall_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    events = [e for t in timed.values() for e in t.events]  # batch 1, bound 205: one graph, in replay order
    graph_us = [us for t in timed.values() for us in t.times_us()]
    cycle_us = [a[0].elapsed_time(b[0]) * 1e3 for a, b in zip(events, events[1:])]
    for table in runner.graph_tables:  # put the graphs back
        for g, (t, logits, meta) in table.items():
            table[g] = (t.graph, logits, meta)
    graph = runner.graphs[1][0]
    back = TimedGraph(graph)
    for _ in range(200):
        back.replay()
    by_context = {c: replay_at(runner, c) for c in (8, 60, 70, 100, 130, 190, 204)}
    with_small = replay_with_small_kernels(runner)
    return {"steps": len(graph_us), "wall_us_per_token": round(wall_us / new_tokens, 1),
            "graph_in_engine_us": _summary(graph_us), "cycle_us": _summary(cycle_us),
            "gap_us": _summary([c - g for c, g in zip(cycle_us, graph_us)]), "host_step_us": _summary(host[1:]),
            "replay_back_to_back_us": _summary(back.times_us()),
            "replay_time_us": round(replay_time_us(graph), 1), "replay_at_context_us": by_context,
            "replay_with_small_kernels_us": with_small}


ATTN = importlib.import_module("brrr.kernels.attention")  # the package exports a function of that name
DECODE = ATTN.decode_attention_triton
PDL = importlib.import_module("brrr.kernels.pdl")
# module flags a setting may change: flag -> (module, default)
FLAGS = {"MODE": (PDL, PDL.MODE), "EARLY_LOADS": (PDL, PDL.EARLY_LOADS), "ROPE_PART": (ATTN, ATTN.ROPE_PART),
         "DECODE_RELEASE": (ATTN, ATTN.DECODE_RELEASE)}
# decode attention settings: name -> (decode kernel keyword arguments, module flags)
SETTINGS = {"pdl": ({}, {}), "off": ({}, {"MODE": 0}), "late": ({}, {"EARLY_LOADS": False}),
            "stages1": ({"num_stages": 1}, {}), "stages2": ({"num_stages": 2}, {}), "stages3": ({"num_stages": 3}, {}),
            "warps2": ({"num_warps": 2}, {}), "warps8": ({"num_warps": 8}, {}), "part32": ({}, {"ROPE_PART": 32}),
            "part128": ({}, {"ROPE_PART": 128}),
            # the release point that was the default before 0faf3bc ("wait" is now): the A/B that replaced it
            "parts": ({}, {"DECODE_RELEASE": "parts"}), "warps4-parts": ({"num_warps": 4}, {"DECODE_RELEASE": "parts"})}


def recapture(runner, max_len: int, name: str) -> None:
    """The batch-1 graphs captured again with decode attention setting `name` (module flags as they were for the
    rest: `restore`)."""
    kwargs, flags = SETTINGS[name]
    for flag, (module, default) in FLAGS.items():
        setattr(module, flag, flags.get(flag, default))
    ATTN.decode_attention_triton = functools.partial(DECODE, **kwargs)
    [table.clear() for table in runner.graph_tables]
    gc.collect(), torch.cuda.empty_cache()
    runner.capture_cuda_graphs(1, -(-max_len // runner.block_size))


def restore() -> None:
    for flag, (module, default) in FLAGS.items():
        setattr(module, flag, default)
    ATTN.decode_attention_triton = DECODE


def by_context(runner, contexts: list[int], max_len: int, settings: list[str]) -> dict:
    """Step time at each context for each decode attention setting (graphs captured again); with PDL off also each
    kernel's time (with PDL a kernel's time includes its wait). The first context timed after a capture can run
    ~3% faster than the rest (docs/quantization.md, "a replay's two levels"): compare settings by `engine_ab`."""
    from brrr.bench.timing import step_kernels

    out, table = {}, runner.g_tables[0].clone()  # the run's blocks (a capture zeroes the table)
    for name in settings:
        recapture(runner, max_len, name)
        with torch.inference_mode():
            runner.g_tables[0].copy_(table)
        for c in contexts:
            rec = out.setdefault(str(c), {})
            rec[name] = replay_at(runner, c)
            if name == "off":
                rec["kernels_off"] = [[k[:50], round(t, 2), round(n, 1)] for k, t, n in
                                      step_kernels(runner.graphs[1][0])[:4]]
    restore()
    return out


def engine_ab(engine, vocab: int, new_tokens: int, max_len: int, settings: list[str], rounds: int) -> dict:
    """Engine decode tok/s (batch 1) under the default decode attention and each setting, alternating, graphs
    captured again before every run."""
    rates = {}
    for _ in range(rounds):
        for name in ["pdl", *settings]:
            recapture(engine.runner, max_len, name)
            _, decode_s = run_batch(engine, 1, 5, new_tokens, vocab, seed=3)
            rates.setdefault(name, []).append(round((new_tokens - 1) / decode_s, 1))
    restore()
    return rates


@torch.inference_mode()
def replay_at(runner, context: int) -> float:
    """Back-to-back replay time of the batch-1 graph with its one sequence at `context` keys (the run's table)."""
    bs = runner.block_size
    runner.g_ctx[0] = context
    runner.g_pos[0] = context - 1
    runner.g_slots[0] = runner.g_tables[0, (context - 1) // bs].long() * bs + (context - 1) % bs
    return round(replay_time_us(runner.graphs[1][0]), 1)


@torch.inference_mode()
def replay_with_small_kernels(runner, n: int = 100) -> float:
    """Replays with work like the engine's between steps before each (an argmax of the logits, a few tiny copies),
    the graph alone timed by events: whether that work slows the graph after it."""
    graph, logits, _ = runner.graphs[1]
    timed = TimedGraph(graph)
    ids = torch.zeros(1, dtype=torch.long, device=logits.device)
    for _ in range(n):
        for t in (runner.g_pos, runner.g_slots, runner.g_ctx):
            t[:1].copy_(t[:1].clone())
        ids.copy_(logits.argmax(-1))
        runner.g_ids[:1].copy_(ids)
        timed.replay()
    return round(statistics.median(timed.times_us()), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--variants", nargs="+", default=["bf16", "w8a16-lmhead", "w4a16-g128-lmhead"])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--contexts", nargs="*", type=int, default=[],
                   help="also: the batch-1 graph captured again for each --attn setting, timed at these contexts")
    p.add_argument("--staging-ab", action="store_true",
                   help="also the engine run with the decode inputs staged by torch copies and by one kernel")
    p.add_argument("--attn", nargs="+", default=["pdl", "off"], choices=list(SETTINGS))
    p.add_argument("--engine-ab", nargs="*", default=[], choices=list(SETTINGS),
                   help="also: engine decode tok/s under the default and these settings, alternating (--rounds)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--trace", default=None,
                   help="also: a torch.profiler Chrome trace of 30 decode steps, to PREFIX-VARIANT.json")
    args = p.parse_args(argv)
    from brrr.bench.random_model import model_config, random_model
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.quant.linear import pack_quantized_projections
    from brrr.quant.methods import quantize_model

    cfg = model_config("llama-3.1-8b")
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    for variant in args.variants:
        model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
        if variant != "bf16":
            quantize_model(model, "rtn-int8" if variant.startswith("w8") else "rtn-int4", group_size=128,
                           lm_head=variant.endswith("-lmhead"))
            pack_quantized_projections(model)
        max_len = 5 + args.new_tokens
        engine = LLMEngine(model, None, EngineConfig(max_model_len=max_len, max_num_seqs=1,
                                                     num_blocks=-(-max_len // 16) + 8, cuda_graphs=True))
        run_batch(engine, 1, 5, 8, cfg.vocab_size, seed=90)  # warm-up: tuning
        _, decode_s = run_batch(engine, 1, 5, args.new_tokens, cfg.vocab_size, seed=1)
        rec = {"bench": "engine_step_gap", "machine": machine, "variant": variant, "new_tokens": args.new_tokens,
               "decode_tok_s": round((args.new_tokens - 1) / decode_s, 1)}
        rec.update(profile(engine, cfg, args.new_tokens))
        emit(rec, args.out)
        if args.trace:  # what runs on the GPU between two graph replays, op by op
            from torch.profiler import ProfilerActivity, profile as torch_profile
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_batch(engine, 1, 5, 30, cfg.vocab_size, seed=3)
            prof.export_chrome_trace(f"{args.trace}-{variant}.json")
            with open(f"{args.trace}-{variant}.json") as f:
                emit({"bench": "engine_between_graphs", "machine": machine, "variant": variant,
                      **between_graphs(json.load(f))}, args.out)
        # the inputs' staging by torch copies and by one kernel, alternating
        for kernel in ((False, True, False, True) if args.staging_ab else ()):
            graph_inputs.STAGING_KERNEL = kernel
            _, decode_s = run_batch(engine, 1, 5, args.new_tokens, cfg.vocab_size, seed=2)
            emit({"bench": "engine_step_gap", "machine": machine, "variant": variant, "staging_kernel": kernel,
                  "decode_tok_s": round((args.new_tokens - 1) / decode_s, 1),
                  **profile(engine, cfg, args.new_tokens)}, args.out)
        graph_inputs.STAGING_KERNEL = True
        if args.engine_ab:
            emit({"bench": "engine_ab", "machine": machine, "variant": variant, "decode_tok_s": engine_ab(
                engine, cfg.vocab_size, args.new_tokens, max_len, args.engine_ab, args.rounds)}, args.out)
        if args.contexts:
            emit({"bench": "engine_step_by_context", "machine": machine, "variant": variant,
                  **by_context(engine.runner, args.contexts, max_len, args.attn)}, args.out)
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
