"""What a preemption costs, swapped to host memory or recomputed, at each prompt length (random weights).

Two requests fill the KV pool exactly: A (admitted first, 2 x max(--lengths) - L prompt tokens) and B (L tokens).
A's first decode takes the pool's one spare block, so B, the newest, is preempted at its first decode step: its
L tokens' blocks are copied to pinned host memory (--preemption-mode swap) or dropped (recompute). When A has made
its --new-tokens, B comes back: its blocks copied in, or its L + 1 tokens prefilled again in chunks of
--max-num-batched-tokens. Everything else both runs do is the same, so per length and mode the record holds:
  preempt_step_s  the step in which B was preempted (swap: the copy out runs in it), beside a plain decode step
  resume_s        the steps from A's last token to B's next one (swap: the copy in; recompute: the prefill again)
  cost_s          preempt_step_s - decode_step_s + resume_s: what the preemption cost the engine
with the cost model's swap and recompute seconds (brrr/analysis/offload.py) beside them.

  PYTHONPATH=$PWD python bench/preemption_resume.py --out bench/results/preemption_h200.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402


def run_pair(engine, long_prompt: list[int], prompt: list[int], new_tokens: int) -> dict:
    """Step A and B to the end; the wall time of each step and what happened in it."""
    from brrr import SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.add_request("A", long_prompt, params)
    engine.add_request("B", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    sched = engine.core.scheduler if hasattr(engine, "core") else engine.scheduler
    made = {"A": 0, "B": 0}
    before, swapped_before = sched.num_preemptions, sched.num_swapped_out  # the engine's counters run on
    steps = []  # (seconds, tokens made by A, by B, preemptions so far)
    while engine.has_unfinished_requests():
        sync()
        t0 = time.perf_counter()
        outs = engine.step()
        sync()
        dt = time.perf_counter() - t0
        new = {}
        for out in outs:
            total = sum(len(c.token_ids) for c in out.outputs)
            new[out.request_id], made[out.request_id] = total - made[out.request_id], total
        steps.append((dt, new.get("A", 0), new.get("B", 0), sched.num_preemptions - before))
    preempted_at = next(i for i, s in enumerate(steps) if s[3] > 0)
    a_done = max(i for i, s in enumerate(steps) if s[1])
    b_back = next(i for i, s in enumerate(steps) if i > a_done and s[2])
    decodes = [s[0] for s in steps[preempted_at + 1:a_done]]  # A alone, batch 1
    decode_s = statistics.median(decodes)
    resume_s = sum(s[0] for s in steps[a_done + 1:b_back + 1])
    return dict(preempt_step_s=steps[preempted_at][0], decode_step_s=decode_s, resume_s=resume_s,
                cost_s=steps[preempted_at][0] - decode_s + resume_s, preemptions=sched.num_preemptions - before,
                swapped_out=sched.num_swapped_out - swapped_before, tokens_b=made["B"])


def main(argv=None):
    from brrr.analysis.hardware import _known_spec
    from brrr.analysis.offload import recompute_seconds, swap_seconds
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.models.random_weights import model_config, random_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="preset name or model directory (random weights)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                    help="B's prompt tokens (multiples of the block size)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens A makes while B waits")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(args.model)
    block = 16
    if any(n % block for n in args.lengths):
        raise SystemExit(f"--lengths must be multiples of the block size {block}")
    pool_tokens = 2 * max(args.lengths)
    num_blocks = pool_tokens // block + 1  # the spare block A's first decode takes
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if dtype == torch.bfloat16 else 4)
    swap_gib = max(1, -(-max(args.lengths) * kv_token // 2**30) + 1)
    gpu = _known_spec(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    model = random_model(cfg, dtype, device)
    machine = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if device.type == "cuda"
               else f"cpu, torch {torch.__version__}")
    for mode in ("recompute", "swap"):
        engine = LLMEngine(model, None, EngineConfig(
            max_model_len=pool_tokens + args.new_tokens + 8, max_num_seqs=2, num_blocks=num_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
            cuda_graphs=args.cuda_graphs == "on" and device.type == "cuda", swap_space=swap_gib,
            preemption_mode=mode))
        for i, length in enumerate(args.lengths):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, cfg.vocab_size, (pool_tokens,), generator=g).tolist()
            got = run_pair(engine, ids[length:], ids[:length], args.new_tokens)
            if got["preemptions"] != 1 or (mode == "swap") != (got["swapped_out"] == 1):
                raise SystemExit(f"no {mode} preemption happened at length {length}: {got}")
            rec = {"bench": "preemption_resume", "machine": machine, "model": f"{args.model} (random weights)",
                   "mode": mode, "prompt_len": length, "max_num_batched_tokens": args.max_num_batched_tokens,
                   **{k: round(v, 5) if isinstance(v, float) else v for k, v in got.items()}}
            if gpu is not None and gpu.pcie:
                rec["model_swap_s"] = round(swap_seconds(cfg, length, gpu), 5)
                rec["model_recompute_s"] = round(recompute_seconds(cfg, length, gpu), 5)
            emit(rec, args.out)
        del engine


if __name__ == "__main__":
    main()
