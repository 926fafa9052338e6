"""What guided decoding adds to a decode step: a batch of B json_schema requests against the same B requests unguided,
the default model (or --model), per-step wall time over the steps where all B rows decode, and inside the guided
steps the host's mask fill (llguidance) and the device's mask application.

    PYTHONPATH=$PWD python bench/guided_overhead.py [--batch 64] [--device cpu] [--out results.jsonl]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import brrr.engine.sampler as sampler
from brrr.config import EngineConfig
from brrr.engine.guided import GuidedMatcher
from brrr.engine import LLMEngine, SamplingParams, StructuredOutputsParams
from brrr.pretrained import load

# Arrays of small records: enums, bounded numbers, nested objects, so the mask changes shape every few tokens (a
# free-text string would make nearly every token allowed, the cheapest mask there is).
ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "kind": {"enum": ["cat", "dog", "bird", "fish"]},
    "score": {"type": "number", "minimum": -10, "maximum": 10},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["name", "zip"], "additionalProperties": False}},
    "required": ["id", "kind", "score", "tags", "owner"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 40}


class Timer:
    """Wraps a function of `owner` and adds up its time (device-synchronized, so the device's share is counted)."""

    def __init__(self, owner, name: str, device: torch.device):
        self.owner, self.name, self.fn, self.total, self.device = owner, name, getattr(owner, name), 0.0, device
        timer = self
        setattr(owner, name, self if not isinstance(owner, type) else lambda *a, **k: timer(*a, **k))

    def restore(self):
        setattr(self.owner, self.name, self.fn)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.total += time.perf_counter() - start
        return out


def run(pretrained, batch: int, steps: int, guided: bool, device: torch.device) -> dict:
    engine = LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(max_num_seqs=batch),
                       pretrained.eos_token_ids)
    spec = StructuredOutputsParams(json=SCHEMA) if guided else None
    for i in range(batch):
        engine.add_request(str(i), "def main(", SamplingParams(max_tokens=steps + 4, seed=i, ignore_eos=True,
                                                               structured_outputs=spec), stream=False)
    timers = {"mask_fill_ms": Timer(sampler, "fill_bitmask", device),
              "mask_apply_ms": Timer(sampler, "apply_token_bitmask", device),
              "advance_ms": Timer(GuidedMatcher, "accept", torch.device("cpu"))}
    times, parts = [], {key: [] for key in timers}
    try:
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            full = len(running) == batch and all(s.num_uncomputed == 1 for s in running)
            before = {key: t.total for key, t in timers.items()}
            start = time.perf_counter()
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if full:
                times.append(time.perf_counter() - start)
                for key, t in timers.items():
                    parts[key].append(t.total - before[key])
    finally:
        for t in timers.values():
            t.restore()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3) if xs else 0.0  # noqa: E731
    return {"guided": guided, "batch": batch, "steps_measured": len(times), "step_ms": ms(times),
            **{key: ms(values) for key, values in parts.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the shipped default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3, help="unguided/guided pairs, interleaved")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="append the records to this JSONL file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pretrained = load(args.model, dtype="float32" if args.device == "cpu" else None, device=args.device)
    device = next(pretrained.model.parameters()).device
    run(pretrained, 8, 8, True, device)  # warm-up: compile the grammar, first-call allocations
    records = []
    for guided in (False, True) * args.rounds:  # interleaved: a noisy machine drifts between runs
        rec = run(pretrained, args.batch, args.steps, guided, device)
        rec.update(device=str(device), vocab=pretrained.model.config.vocab_size, threads=torch.get_num_threads(),
                   machine=platform.processor() or platform.machine())
        records.append(rec)
        print(json.dumps(rec))
    # what an unguided batch pays: the sampler's scan for rows with a grammar or a logit_bias
    rows = [sampler.SampleRow(SamplingParams(seed=i), seed=i) for i in range(args.batch)]
    logits = torch.zeros(args.batch, pretrained.model.config.vocab_size, device=device)
    start = time.perf_counter()
    for _ in range(1000):
        sampler.constrain(logits, rows)
    print(f"unguided batch of {args.batch}: the constrain scan takes {(time.perf_counter() - start) * 1e3:.3f} us")
    plain = statistics.median(r["step_ms"] for r in records if not r["guided"])
    guided = [r for r in records if r["guided"]]
    own = statistics.median(r["mask_fill_ms"] + r["mask_apply_ms"] + r["advance_ms"] for r in guided)
    guided = statistics.median(r["step_ms"] for r in guided)
    print(f"step, median over rounds: guided {guided:.3f} ms vs unguided {plain:.3f} ms "
          f"(+{(guided / plain - 1) * 100:.1f}%); the guided path's own work {own:.3f} ms ({own / plain * 100:.1f}%)")
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
