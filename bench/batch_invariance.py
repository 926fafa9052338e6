"""What the batch-invariant mode costs and what it buys: RL-style rollouts (prompts x generations, sampled at
temperature 1 with the sampled token's logprob) through the engine with the mode off and on, timed, then each
rollout's logprobs recomputed the way a trainer does (one forward over prompt + completion, log-softmax; the mode on
for the "on" run) and compared: max and mean |delta logprob| and the fraction of tokens equal bit for bit.

    PYTHONPATH=$PWD python bench/batch_invariance.py --device cpu --out bench/results/batch_invariance_cpu.jsonl
    PYTHONPATH=$PWD python bench/batch_invariance.py --model qwen3-0.6b --device cuda --prompts 64 \\
        --generations 8 --max-tokens 256 --out bench/results/batch_invariance_h200.jsonl

--model: a preset (random weights) or a model directory; default the shipped default model (trained weights).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

import torch

from brrr.config import EngineConfig
from brrr.default_model import default_model_dir
from brrr.engine import LLMEngine
from brrr.kernels import AttnMeta
from brrr.kernels.batch_invariant import batch_invariant
from brrr.kernels.log_softmax import log_softmax
from brrr.loader import load_model, resolve_dtype
from brrr.models.random_weights import model_config, random_model
from brrr.presets import PRESETS
from brrr.sampling_params import SamplingParams


def _model(spec: str, dtype, device):
    if spec in PRESETS:
        return random_model(model_config(spec), dtype, device)
    return load_model(spec, dtype=dtype, device=device)


def _rollouts(engine, prompts, generations, max_tokens, seed0):
    """{request id: (prompt, tokens, logprobs)} for every prompt x generation, and the output tokens/s."""
    requests = {}
    for i, prompt in enumerate(prompts):
        for g in range(generations):
            rid = f"{seed0}-{i}-{g}"
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed0 + i * generations + g,
                                    logprobs=0, ignore_eos=True)
            engine.add_request(rid, prompt, params, stream=False)
            requests[rid] = prompt
    done = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            done[out.request_id] = (requests[out.request_id], o.token_ids,
                                    [lp[t] for lp, t in zip(o.logprobs, o.token_ids)])
    seconds = time.perf_counter() - start
    return done, sum(len(t) for _, t, _ in done.values()) / seconds


@torch.no_grad()
def _trainer_logprobs(model, rollouts, invariant: bool, batch: int):
    """Each rollout's sampled-token logprobs from full-sequence forwards, `batch` sequences a varlen forward."""
    device = next(model.parameters()).device
    out = []
    items = list(rollouts.values())
    for b0 in range(0, len(items), batch):
        group = items[b0:b0 + batch]
        seqs = [p + t for p, t, _ in group]
        ids = torch.tensor([x for s in seqs for x in s], device=device)
        positions = torch.cat([torch.arange(len(s)) for s in seqs]).to(device)
        with batch_invariant() if invariant else contextlib.nullcontext():
            hidden = model(ids, positions, AttnMeta.causal([len(s) for s in seqs], device))
            rows, targets, start = [], [], 0
            for p, t, _ in group:
                rows += range(start + len(p) - 1, start + len(p) + len(t) - 1)
                targets += t
                start += len(p) + len(t)
            lp = log_softmax(model.compute_logits(hidden[torch.tensor(rows, device=device)]))
        out.append(lp.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].float().cpu())
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--trainer-batch", type=int, default=8, help="sequences a recomputation forward takes")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds a mode (fresh prompts each), the best one kept: a shared machine's load moves")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, None, device) if args.dtype == "auto" else getattr(torch, args.dtype)
    vocab = model_config(args.model).vocab_size
    rounds = []
    for r in range(args.repeats):
        rng = random.Random(r)
        rounds.append([[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)])
    trainer = _model(args.model, dtype, device)  # the reference form, as a trainer holds it
    record = {"bench": "batch_invariance", "model": args.model.rsplit("/", 1)[-1], "device": args.device,
              "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "torch_threads": torch.get_num_threads(), "prompts": args.prompts,
              "generations": args.generations, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "repeats": args.repeats}
    for mode in ("off", "on"):
        config = EngineConfig(max_model_len=args.prompt_len + args.max_tokens + 8, batch_invariant=mode == "on",
                              **({"num_blocks": 2048} if device.type == "cpu" else {}))
        engine = LLMEngine(_model(args.model, dtype, device), None, config)
        _rollouts(engine, rounds[0][:2], 2, 8, 10**6)  # warm-up: compiles, lazy buffers (other seeds: no cache hits)
        runs = [_rollouts(engine, prompts, args.generations, args.max_tokens, 10**5 * r)
                for r, prompts in enumerate(rounds)]
        rollouts, tok_s = runs[0][0], max(t for _, t in runs)
        got = torch.tensor([x for _, _, lps in rollouts.values() for x in lps], dtype=torch.float32)
        want = _trainer_logprobs(trainer, rollouts, mode == "on", args.trainer_batch)
        delta = (got - want).abs()
        record[mode] = {"output_tok_s": round(tok_s, 1), "max_abs_delta_logprob": delta.max().item(),
                        "mean_abs_delta_logprob": delta.mean().item(),
                        "bit_identical_fraction": round((delta == 0).float().mean().item(), 6)}
        del engine
    record["cost_x"] = round(record["off"]["output_tok_s"] / record["on"]["output_tok_s"], 3)
    line = json.dumps(record)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
