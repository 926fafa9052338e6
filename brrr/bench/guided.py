"""`brrr bench guided`: what grammar-guided decoding adds to a decode step. B json_schema requests against the same
B requests unguided, interleaved rounds, the per-step wall time over steps where all B rows decode. A last guided
round, not timed, wraps the three guided parts in clocks to split them out per step: the mask fill (on the engine's
mask thread, overlapped with the forward), the mask's application and the matchers' advance. (A profiler such as
cProfile slows the host enough to stall the pipeline, and the step it times is then not the step a server runs.)"""
from __future__ import annotations

import statistics
import time

from brrr.bench.latency import emit
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.errors import BrrrError
from brrr.models.random_weights import model_config, random_model
from brrr.presets import PRESETS
from brrr.pretrained import Pretrained, load
from brrr.sampling_params import SamplingParams, StructuredOutputsParams
from brrr.tokenizer import Tokenizer

# Arrays of small records: enums, bounded numbers, nested objects, so the mask changes shape every few tokens (a
# free-text string would allow nearly every token, the cheapest mask there is).
_ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "kind": {"enum": ["cat", "dog", "bird", "fish"]},
    "score": {"type": "number", "minimum": -10, "maximum": 10},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["name", "zip"], "additionalProperties": False}},
    "required": ["id", "kind", "score", "tags", "owner"], "additionalProperties": False}
_SCHEMA = {"type": "array", "items": _ITEM, "minItems": 40}
# each part: where the engine calls its function from, (module, attribute) (the fill: the mask thread of a pipelined
# step, or the sampler of a step that fills its own masks)
_PARTS = {"mask_fill_ms": [("brrr.engine.guided.feature", "fill_bitmask"), ("brrr.engine.sampler", "fill_bitmask")],
          "mask_apply_ms": [("brrr.engine.sampler", "apply_token_bitmask")],
          "advance_ms": [("brrr.engine.guided.backend", "GuidedMatcher.accept")]}


def register(bench_sub) -> None:
    p = bench_sub.add_parser("guided", help="decode step time with json_schema guided decoding vs without")
    p.add_argument("--model", default=None, help="a model directory (default: the shipped default model), or a preset "
                   "name (random weights of that shape, bf16; needs --tokenizer)")
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json, for a preset --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3, help="unguided/guided pairs, interleaved")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_guided)


def _run(engine, batch: int, steps: int, guided: bool) -> dict:
    spec = StructuredOutputsParams(json=_SCHEMA) if guided else None
    for i in range(batch):
        engine.add_request(str(i), "def main(", SamplingParams(max_tokens=steps + 4, seed=i, ignore_eos=True,
                                                               structured_outputs=spec), stream=False)
    # No synchronization here: decode steps are pipelined (each step() returns once the previous step's tokens are
    # read), and a wait for an idle GPU after every step would time the pipeline's drain and refill instead of the
    # steady state a server sees.
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == batch and all(s.num_uncomputed == 1 for s in running)
        start = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - start)
    step_ms = statistics.median(times) * 1e3 if times else 0.0
    return {"guided": guided, "batch": batch, "steps_measured": len(times), "step_ms": round(step_ms, 3),
            "tok_s": round(batch / (step_ms / 1e3), 1) if times else 0.0}


def _parts(engine, batch: int, steps: int) -> dict:
    """A guided round with each part's function wrapped in a clock: its total time over the round per step where all
    rows decode."""
    import importlib

    spent = dict.fromkeys(_PARTS, 0.0)
    originals = []
    for key, places in _PARTS.items():
        for module, attr in places:
            owner = importlib.import_module(module)
            if "." in attr:
                cls, attr = attr.split(".")
                owner = getattr(owner, cls)
            fn = getattr(owner, attr)

            def timed(*a, _fn=fn, _key=key, **kw):
                start = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    spent[_key] += time.perf_counter() - start  # float += under the GIL: safe across threads

            originals.append((owner, attr, fn))
            setattr(owner, attr, timed)
    try:
        n = max(1, _run(engine, batch, steps, True)["steps_measured"])
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    return {"guided": True, "batch": batch, "steps": n, **{k: round(v / n * 1e3, 3) for k, v in spent.items()}}


def _preset(args):
    """Random weights of a preset's shape with a real tokenizer: the mask's cost depends on the vocabulary (its size
    and its tokens' strings), the step's on the shape; neither on the weights' values."""
    from pathlib import Path

    import torch

    if not args.tokenizer:
        raise BrrrError(f"--model {args.model} is a preset (random weights): --tokenizer DIR must give its vocabulary")
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    cfg = model_config(args.model)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise BrrrError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than {args.model}'s vocabulary "
                        f"({cfg.vocab_size})")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = random_model(cfg, dtype, args.device)
    eos = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    return Pretrained(Path(args.tokenizer), model, tokenizer, eos)


def cmd_guided(args) -> int:
    import platform

    import torch

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if args.model in PRESETS:
        pretrained = _preset(args)
    else:
        pretrained = load(args.model, dtype="float32" if args.device == "cpu" else None, device=args.device)
    device = next(pretrained.model.parameters()).device
    # one engine for every run (the graphs are captured once); max_model_len bounds the KV cache to what runs need
    engine = LLMEngine(pretrained.model, pretrained.tokenizer,
                       EngineConfig(max_num_seqs=args.batch, max_model_len=args.steps + 64), pretrained.eos_token_ids)
    _run(engine, 8, 8, True)  # warm-up: the grammar's compilation, first-call allocations
    records = []
    for guided in (False, True) * args.rounds:  # interleaved: a noisy machine drifts between runs
        rec = _run(engine, args.batch, args.steps, guided)
        rec.update(device=str(device), vocab=pretrained.model.config.vocab_size, threads=torch.get_num_threads(),
                   machine=platform.processor() or platform.machine())
        records.append(rec)
        emit(rec, args.out)
    plain = statistics.median(r["step_ms"] for r in records if not r["guided"])
    guided = statistics.median(r["step_ms"] for r in records if r["guided"])
    parts = _parts(engine, args.batch, args.steps)
    parts.update(device=str(device), threads=torch.get_num_threads())
    emit(parts, args.out)
    summary = {"summary": "guided", "batch": args.batch, "guided_step_ms": guided, "unguided_step_ms": plain,
               "guided_vs_unguided_throughput": round(plain / guided, 3), "device": str(device)}
    emit(summary, args.out)
    print(f"decode step, median over rounds: guided {guided:.3f} ms vs unguided {plain:.3f} ms: guided throughput "
          f"{plain / guided:.2f}x unguided; per guided step (a clocked round): mask fill {parts['mask_fill_ms']} ms "
          f"(mask thread), apply {parts['mask_apply_ms']} ms, advance {parts['advance_ms']} ms")
    return 0
