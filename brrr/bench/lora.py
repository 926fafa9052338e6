"""`brrr bench lora`: multi-LoRA serving on a GPU: decode throughput of a batch mixing adapters against the base
model alone on the same requests, and the LoRA kernels' device time per layer against their memory roofline.

    brrr bench lora --model llama-3.1-8b --num-adapters 8 --rank 16 --batch 64 --out FILE

Random weights of the preset's shape (brrr.models.random_weights) and random rank-r adapters on all 7 projections,
written in PEFT's format and loaded through the engine's own path. Three engine runs on the same requests:
`base` (no LoRA), `lora-base-rows` (LoRA enabled, every request on the base: the cost of the wrapped modules
alone) and `lora-mixed` (request i runs adapter i % num_adapters). Decode tok/s is timed over steps in which every
sequence decodes; `graph_step_us` is the device time of the captured decode step at that batch size."""
from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

from brrr.analysis.finetune import DEFAULT_TARGETS
from brrr.analysis.hardware import measure
from brrr.bench.latency import emit, require_at_least
from brrr.bench.timing import step_kernels
from brrr.config import EngineConfig
from brrr.engine import LLMEngine, LoRARequest
from brrr.errors import BrrrError
from brrr.kernels.graph_timing import graph_time_us, replay_time_us
from brrr.kernels.lora import lora_apply, lora_rows
from brrr.lora import LoraAdapter, LoraConfig, save_adapter
from brrr.lora.serving import projection_shapes
from brrr.models.random_weights import model_config, random_model
from brrr.sampling_params import SamplingParams



def write_adapters(cfg, n: int, rank: int, root: Path) -> list:
    import torch

    shapes = projection_shapes(cfg)
    requests = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        weights = {name: ((torch.randn(rank, fan_in, generator=g) / fan_in**0.5).bfloat16(),
                          (torch.randn(fan_out, rank, generator=g) * 0.01).bfloat16())
                   for name, (fan_in, fan_out) in shapes.items()}
        path = save_adapter(root / f"adapter{i}", LoraAdapter(LoraConfig(rank, 2.0 * rank, DEFAULT_TARGETS), weights))
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return requests


def decode_run(model, cfg, args, loras: list | None, enable_lora: bool) -> dict:
    """Prefill `batch` requests, then time decode steps in which all of them decode."""
    import torch

    engine = LLMEngine(model, None, EngineConfig(
        num_blocks=args.batch * -(-(args.prompt_len + args.warm_steps + args.steps + 32) // 16) + 64,
        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch), enable_lora=enable_lora,
        max_loras=max(1, args.num_adapters), max_lora_rank=args.rank))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.warm_steps + args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
        engine.add_request(str(i), prompt, params, lora_request=None if loras is None else loras[i % len(loras)])
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills (and their first tokens)
    for _ in range(args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    before, start = engine.generation_tokens_total, time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = engine.generation_tokens_total - before
    graph, _, _ = engine.runner.graph_for(args.batch, args.prompt_len + args.warm_steps + args.steps)
    record = {"decode_tok_s": round(tokens / seconds, 1), "decode_steps": args.steps, "tokens": tokens,
              "graph_step_us": round(replay_time_us(graph), 1), "num_preemptions": engine.stats()["num_preemptions"],
              "adapter_loads": engine.lora.loads if engine.lora else 0}
    if enable_lora:  # the LoRA kernels inside the captured step (torch.profiler): their share of it
        kernels = [(name, us, n) for name, us, n in step_kernels(graph) if "_shrink_" in name or "_expand_" in name]
        record["lora_kernels_us_per_step"] = round(sum(us for _, us, _ in kernels), 1)
        record["lora_kernel_launches_per_step"] = round(sum(n for _, _, n in kernels))
    while engine.has_unfinished_requests():  # abort the rest: the model is reused by the next run
        for request_id in list(engine.requests):
            engine.abort(request_id)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return record


def kernel_records(cfg, args, gpu) -> list[dict]:
    """Each serving module's LoRA update (shrink + expand) at the decode batch, rows spread evenly over the
    adapters: device time, bytes it must move (the active adapters' A and B, x, y read and written) and the fraction
    of the copy roofline; beside it the module's own bf16 GEMM. The `layer` record sums a layer's modules and adds
    what a step does once (group the rows, zero the shrink buffer of every module)."""
    import torch

    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    modules = {"qkv_proj": (h, (q, kv, kv)), "o_proj": (q, (h,)), "gate_up_proj": (h, (inter, inter)),
               "down_proj": (inter, (h,))}
    slots, rank, n, dev = args.num_adapters, max(16, args.rank), args.batch, "cuda"
    row_slots = (torch.arange(n, device=dev) % slots).to(torch.int32)
    records, total_us, total_roof = [], 0.0, 0.0
    for name, (fan_in, outs) in modules.items():
        out = sum(outs)
        x = torch.randn(n, fan_in, device=dev, dtype=torch.bfloat16)
        a = torch.randn(slots, len(outs) * rank, fan_in, device=dev, dtype=torch.bfloat16) / fan_in**0.5
        b = torch.randn(slots, out, rank, device=dev, dtype=torch.bfloat16) * 0.01
        y = torch.randn(n, out, device=dev, dtype=torch.bfloat16)
        w = torch.randn(out, fan_in, device=dev, dtype=torch.bfloat16)
        offsets = tuple(int(v) for v in torch.tensor([0, *outs]).cumsum(0))
        offsets_t = torch.tensor(offsets, dtype=torch.int32, device=dev)
        rows = lora_rows(row_slots, slots)
        # the engine zeroes one shrink buffer a step for every module (the `step` record), not one per module
        t = torch.zeros(n, a.shape[1], dtype=torch.float32, device=dev)
        us = graph_time_us([lambda: lora_apply(y, x, a, b, rows, offsets, offsets_t, t)] * 10)
        gemm_us = graph_time_us([lambda: x @ w.T] * 10)
        active = len(set(row_slots.tolist()))
        nbytes = 2 * (active * (a.shape[1] * fan_in + out * rank) + n * fan_in + 2 * n * out) + 4 * n * a.shape[1] * 2
        roof_us = nbytes / gpu.bandwidth * 1e6
        total_us, total_roof = total_us + us, total_roof + roof_us
        records.append({"bench": "lora_kernel", "module": name, "batch": n, "adapters": active, "rank": rank,
                        "device_us": round(us, 2), "bytes": nbytes, "roofline_us": round(roof_us, 2),
                        "fraction_of_roofline": round(roof_us / us, 3), "base_gemm_us": round(gemm_us, 2)})
    width = cfg.num_layers * sum(len(outs) * rank for _, outs in modules.values())
    rows_us = graph_time_us([lambda: (lora_rows(row_slots, slots), torch.zeros(n, width, device=dev))] * 10)
    records.append({"bench": "lora_kernel", "module": "layer", "batch": n, "adapters": slots, "rank": rank,
                    "device_us": round(total_us, 2), "roofline_us": round(total_roof, 2),
                    "fraction_of_roofline": round(total_roof / total_us, 3),
                    "row_grouping_us_per_step": round(rows_us, 2),
                    "layers": cfg.num_layers, "lora_us_per_step": round(total_us * cfg.num_layers + rows_us, 1)})
    return records


def register(bench_sub) -> None:
    p = bench_sub.add_parser("lora", help="multi-LoRA decode tok/s vs the base model, and the LoRA kernels' roofline",
                             description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warm-steps", type=int, default=16)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--sections", nargs="+", default=["kernels", "decode"], choices=["kernels", "decode"])
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_lora)


def cmd_lora(args) -> int:
    import torch

    require_at_least(num_adapters=(args.num_adapters, 1), rank=(args.rank, 1), batch=(args.batch, 1),
                     prompt_len=(args.prompt_len, 1), warm_steps=(args.warm_steps, 0), steps=(args.steps, 1))
    if not torch.cuda.is_available():
        raise BrrrError("brrr bench lora measures a GPU; torch sees no CUDA device")
    cfg, gpu = model_config(args.model), measure()
    common = {"model": args.model, "machine": gpu.name, "measured_bandwidth": round(gpu.bandwidth)}
    if "kernels" in args.sections:
        for record in kernel_records(cfg, args, gpu):
            emit({**record, **common}, args.out)
    if "decode" not in args.sections:
        return 0
    model = random_model(cfg, torch.bfloat16, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        loras = write_adapters(cfg, args.num_adapters, args.rank, Path(tmp))
        runs = {"base": (None, False), "lora-base-rows": (None, True), "lora-mixed": (loras, True)}
        results = {}
        for run, (run_loras, enable) in runs.items():
            head = {"bench": "lora_serving", "run": run, "batch": args.batch,
                    "adapters": args.num_adapters if run_loras else 0, "rank": args.rank}
            try:
                results[run] = decode_run(model, cfg, args, run_loras, enable)
            except Exception as e:  # the other runs still measure; the record says why this one did not
                emit({**head, "error": f"{type(e).__name__}: {e}", **common}, args.out)
                continue
            emit({**head, **results[run], **common}, args.out)
    if len(results) < len(runs):
        return 1
    base = results["base"]["decode_tok_s"]
    emit({"bench": "lora_serving", "run": "summary", "batch": args.batch, "adapters": args.num_adapters,
          "rank": args.rank, "mixed_vs_base": round(results["lora-mixed"]["decode_tok_s"] / base, 3),
          "lora_base_rows_vs_base": round(results["lora-base-rows"]["decode_tok_s"] / base, 3),
          "graph_mixed_vs_base": round(results["base"]["graph_step_us"] / results["lora-mixed"]["graph_step_us"], 3),
          "target": 0.8, **common}, args.out)
    return 0

