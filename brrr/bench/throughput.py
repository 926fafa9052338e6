"""`brrr bench throughput`: offline throughput on nano-vllm's protocol (N requests, input and output lengths
uniform in [min, max], ignore_eos), against a roofline cost model of the very schedule the engine ran:
each step costs max(bytes / measured bandwidth, FLOPs / measured matmul rate)."""
from __future__ import annotations

import random
import time

from brrr.analysis.formats import dtype_format
from brrr.analysis.hardware import measure
from brrr.analysis.model import decode_weight_bytes, flops_per_token, kv_bytes_per_token
from brrr.bench.latency import emit
from brrr.config import COMPACTING_EVICTIONS, EngineConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.engine import LLMEngine
from brrr.engine.engine_process_warmup import warm_up
from brrr.errors import BrrrError
from brrr.loader import resolve_dtype
from brrr.models.random_weights import model_config, random_model
from brrr.sampling_params import SamplingParams


def register(bench_sub) -> None:
    p = bench_sub.add_parser("throughput", help="offline output tok/s and the fraction of the roofline cost model")
    p.add_argument("--model", default="qwen3-0.6b", help="preset name or model directory (random weights)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs, one rank each")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine in the batch-invariant mode (docs/batch-invariance.md): what it costs")
    add_kv_cache_args(p)
    p.add_argument("--profile", action="store_true",
                   help="run the workload once more under torch.profiler: device time by kernel category (GEMM, "
                        "attention, norms and activations, sampling, ...) and device idle, beside the cost model")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_throughput)


def step_terms(cfg, items, gpu, dtype: str) -> tuple[float, float]:
    """(seconds to move the step's bytes, seconds for its FLOPs) at the measured rates; items = [(tokens already
    computed, tokens this step)] per sequence."""
    kv = kv_bytes_per_token(cfg, dtype)
    nbytes = decode_weight_bytes(cfg, len(items), dtype)
    flops = 0.0
    for start, n in items:
        nbytes += kv * (start + n)  # read the context's K/V, new tokens included (written once, read back)
        flops += n * flops_per_token(cfg, start + (n + 1) // 2)  # mean context over the chunk
    return nbytes / gpu.bandwidth, flops / gpu.peak("bf16" if dtype == "bf16" else dtype)


def step_cost(cfg, items, gpu, dtype: str) -> float:
    """Roofline seconds for one step: the larger of its two terms."""
    return max(step_terms(cfg, items, gpu, dtype))


def by_step_kind(cfg, schedule, durations, gpu, dtype: str, tp: int) -> dict:
    """Decode-only steps and steps with prefill chunks apart: for each, steps, measured seconds (host clock between
    step returns: with launch-ahead that is the device's pace), the model's seconds and its two terms."""
    kinds = {}
    for items, seconds in zip(schedule, durations):
        kind = kinds.setdefault("decode" if all(n == 1 for _, n in items) else "prefill_or_mixed",
                                {"steps": 0, "seconds": 0.0, "model_seconds": 0.0, "bytes_seconds": 0.0,
                                 "flops_seconds": 0.0})
        b, f = step_terms(cfg, items, gpu, dtype)
        kind["steps"] += 1
        kind["seconds"] += seconds
        kind["model_seconds"] += max(b, f) / tp
        kind["bytes_seconds"] += b / tp
        kind["flops_seconds"] += f / tp
    return {k: {n: round(v, 3) if isinstance(v, float) else v for n, v in d.items()} for k, d in kinds.items()}


# kernel name patterns -> category, first match wins (brrr's Triton kernels, cuBLAS/cuDNN and torch's own)
KERNEL_CATEGORIES = (
    ("attention", r"prefill_kernel|decode_kernel|decode_parts|lean_|combine_parts|flash|fmha|attn|attention"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|_mma|splitk|w4a16|w8a16"),
    ("kv_write", r"write_kv|reshape_and_cache"),
    ("norm_rope_act", r"rms_norm|rotary|rope|silu|cos_sin"),
    ("sampling", r"argmax|gumbel|softmax|sort|topk|bitmask|cumsum"),
    ("copy_index", r"copy|index|gather|scatter|cat|fill|stage"),
)


def kernel_categories(events, window_us: float) -> dict:
    """Device microseconds by category of the profiled kernels (name, start, duration), the ten kernels that took
    longest (name cut to 80 characters), and the device's idle time in the window: the window less the union of
    kernel intervals."""
    import re

    patterns = [(name, re.compile(rx, re.I)) for name, rx in KERNEL_CATEGORIES]
    totals: dict[str, float] = {}
    by_name: dict[str, float] = {}
    spans = []
    for name, start, dur in events:
        cat = next((c for c, rx in patterns if rx.search(name)), "other")
        totals[cat] = totals.get(cat, 0.0) + dur
        by_name[name[:80]] = by_name.get(name[:80], 0.0) + dur
        spans.append((start, start + dur))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"kernel_us": {k: round(v) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_kernels_us": {k: round(v) for k, v in top},
            "busy_us": round(busy), "idle_us": round(max(0.0, window_us - busy)), "window_us": round(window_us)}


def add_workload(engine, cfg, args) -> None:
    rng = random.Random(0)
    for i in range(args.num_requests):
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
        params = SamplingParams(max_tokens=rng.randint(args.min_len, args.max_len), temperature=0.6, ignore_eos=True,
                                seed=i)
        engine.add_request(str(i), prompt, params, stream=False)  # offline: only final outputs, as LLM.generate


def profiled_run(engine, cfg, args) -> dict:
    """The workload again under torch.profiler (CUDA activity only): kernel time by category and device idle."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    add_workload(engine, cfg, args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        window_us = (time.perf_counter() - start) * 1e6
    events = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    return kernel_categories(events, window_us)


def cmd_throughput(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise BrrrError("brrr bench throughput measures a GPU; torch sees no CUDA device")
    cfg = model_config(args.model)
    dtype = resolve_dtype(args.dtype, cfg, torch.device("cuda"))
    short = dtype_format(dtype)
    gpu = measure()
    tp = args.tensor_parallel_size
    config = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          max_model_len=2 * args.max_len + 8, gpu_memory_utilization=args.gpu_memory_utilization,
                          cuda_graphs=args.cuda_graphs == "on", tensor_parallel_size=tp,
                          batch_invariant=args.batch_invariant, **kv_cache_config(args),
                          # (no --no-prefix-caching here: the policies that rewrite blocks in place turn it off)
                          enable_prefix_caching=args.kv_eviction not in COMPACTING_EVICTIONS)
    if tp > 1:
        from brrr.distributed.tp_loader import load_tensor_parallel  # TP only: torch.distributed and workers

        model, config = load_tensor_parallel(cfg, tp, dtype, torch.device("cuda"), config)  # each rank its shard
    else:
        model = random_model(cfg, dtype, "cuda")
    engine = LLMEngine(model, None, config)
    # Triton compiles and autotunes a kernel the first time it meets a shape, seconds that would otherwise land in
    # the timed run: first the server's warm-up (every prefill length bucket up to the model length, which a
    # preempted sequence's recompute of prompt + output reaches: the workload's own prompts do not), then a
    # rehearsal of the workload's shapes (long prompts, chunked prefill, sampled decodes) with its own random stream.
    warm_up(engine)
    warm = random.Random(1)
    for i in range(16):
        length = args.max_len if i < 4 else warm.randint(args.min_len, args.max_len)
        engine.add_request(f"warm-{i}", [warm.randrange(cfg.vocab_size) for _ in range(length)],
                           SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True, seed=i), stream=False)
    while engine.has_unfinished_requests():
        engine.step()
    add_workload(engine, cfg, args)
    engine.schedule_log = schedule = []  # each step's (computed, new) per sequence; costed after the clock stops
    generated0 = engine.generation_tokens_total
    marks = []  # the host clock at each step's return (a step planned ahead logs its schedule a step early)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        marks.append(time.perf_counter())
    seconds = time.perf_counter() - start
    engine.schedule_log = None
    out_tokens = engine.generation_tokens_total - generated0
    durations = [b - a for a, b in zip([start] + marks, marks)]
    profile = profiled_run(engine, cfg, args) if args.profile else None
    if tp > 1:
        engine.runner.shutdown()
    # each of the tp GPUs reads and computes 1/tp of a step (the all-reduces are not in the model: they are the gap)
    model_s, steps = sum(step_cost(cfg, items, gpu, short) for items in schedule) / tp, len(schedule)
    stats = engine.stats()
    emit({"bench": "throughput", "model": args.model, "dtype": short, "machine": gpu.name, "runner": "brrr",
          "cuda_graphs": args.cuda_graphs, "tensor_parallel_size": tp, "batch_invariant": args.batch_invariant,
          "num_requests": args.num_requests, "lengths": [args.min_len, args.max_len], "kv_cache_dtype": args.kv_cache_dtype,
          "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
          "num_blocks": stats["num_blocks"], "steps": steps, "preemptions": stats["num_preemptions"],
          "seconds": round(seconds, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / seconds, 1),
          "roofline_seconds": round(model_s, 3), "fraction_of_roofline": round(model_s / seconds, 3),
          "measured_bandwidth": round(gpu.bandwidth), "measured_bf16_flops": round(gpu.peak("bf16")),
          "by_step_kind": by_step_kind(cfg, schedule, durations, gpu, short, tp),
          **({"profile": profile} if profile else {})}, args.out)
    return 0
