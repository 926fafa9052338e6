"""Where a speculative round's time goes, beside a plain decode step, in one run on one GPU.

Random weights of a training shape (brrr-300m: the target of bench/spec_trained.sh) with a random EAGLE head: a
round's cost does not depend on the values (nothing is accepted, so each round emits one token; the trained pair's
acceptance turns round cost into speedup: speedup = tokens per round x plain step / round). For each method (none,
eagle, ngram at k = --k) one request decodes greedily at batch 1 and the profiler records --steps steady engine
steps. A record per method: wall ms per step, the GPU's busy time per step (union of kernel intervals), the host's
time inside CUDA-graph launches, inside host<->device copies that wait (the read of the step's tokens), kernels per
step. Host-bound when wall >> GPU busy.

  PYTHONPATH=$PWD python bench/spec_round.py --out bench/results/spec_round_h200.jsonl
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.config import EngineConfig  # noqa: E402
from brrr.engine.llm_engine import LLMEngine  # noqa: E402
from brrr.models.eagle import new_head, save_head  # noqa: E402
from brrr.models.random_weights import random_model  # noqa: E402
from brrr.sampling_params import SamplingParams  # noqa: E402
from brrr.train.shapes import resolve_config  # noqa: E402

SPECIAL = {"bos": 1, "eos": 2, "pad": 0, "im_end": 3, "im_start": 4}


def busy_us(events) -> float:
    """The union of the kernels' and copies' device intervals."""
    total, start, end = 0.0, None, None
    for s, e in sorted((ev.time_range.start, ev.time_range.end) for ev in events):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total if end is None else total + end - start


def host_us(prof, name: str) -> float:
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == name)


def measure(model, method: str, k: int, head_dir: str, prompt: list[int], steps: int) -> dict:
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": k,
                                          **({"model": head_dir} if method == "eagle" else {})}
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                                 speculative_config=spec))
    params = SamplingParams(max_tokens=model.config.max_context - len(prompt) - 1, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("timed", prompt, params)
    for _ in range(40):  # past the prefill: steady decoding
        engine.step()
    torch.cuda.synchronize()
    tokens_before = engine.stats()["generation_tokens"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    tokens = engine.stats()["generation_tokens"] - tokens_before
    engine.abort("timed")
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = [e for e in prof.key_averages() if e.key == "cudaGraphLaunch"]
    return {"method": method, "k": k if spec else None, "steps": steps, "tokens_per_step": tokens / steps,
            "wall_ms_per_step": wall / steps * 1e3, "gpu_busy_ms_per_step": busy_us(device) / steps / 1e3,
            "graph_launches_per_step": launches[0].count / steps if launches else 0,
            "host_ms_in_graph_launch_per_step": host_us(prof, "cudaGraphLaunch") / steps / 1e3,
            "host_ms_in_copies_per_step": host_us(prof, "cudaMemcpyAsync") / steps / 1e3,
            "kernels_per_step": len(device) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="brrr-300m", help="a training shape or preset (random weights)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--steps", type=int, default=100, help="profiled engine steps per method")
    ap.add_argument("--out", help="append the JSON records here")
    args = ap.parse_args()
    cfg = resolve_config(args.shape, args.vocab, SPECIAL, 1024)
    model = random_model(cfg, torch.bfloat16, "cuda")
    head_dir = tempfile.mkdtemp()
    save_head(new_head(model).to(torch.bfloat16), head_dir)
    # a context that repeats a 16-token unit: prompt lookup proposes every round (and a random target rejects)
    unit = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    base = None
    for method in ("none", "eagle", "ngram"):
        rec = measure(model, method, args.k, head_dir, unit * 16, args.steps)
        base = base or rec["wall_ms_per_step"]
        rec.update(bench="spec_round", shape=args.shape, batch=1, round_vs_plain_step=rec["wall_ms_per_step"] / base,
                   machine=torch.cuda.get_device_name(), host=platform.node(), torch=torch.__version__)
        emit(rec, args.out)


if __name__ == "__main__":
    main()
