"""Warm-up: a few requests through the engine before the server says it is ready, so that first-call costs are paid
here and not by the first users. On a GPU the large one is Triton compiling (and, for long prefill chunks,
autotuning) kernels the first time they meet a new specialization: a run without warm-up pays it in the first
requests' time to first token.

The CUDA graphs compile the decode steps they capture. What runs eagerly is planned by the attention kernels'
plan functions (brrr/kernels/attention/plan.py), which the shapes below are derived from: decodes inside mixed
prefill steps, short and long enough for the split kernel to split them; prefill chunks in the fixed-tile and the
autotuned length buckets; a decode batch too wide for the lean kernel; one prompt alone per tuning bucket of the
quantized matmuls (`bucket_sizes`), so nothing is timed while serving; and a guided request, so the grammar
library reads the vocabulary before the first user's.
"""
from __future__ import annotations

import logging

from brrr.engine.llm_engine import LLMEngine
from brrr.kernels.attention.plan import AUTOTUNE_MIN_TOKENS, decode_plan
from brrr.kernels.quant.tune import bucket_sizes
from brrr.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("brrr.engine")
BUDGET = -1  # a prompt as long as the step's token budget


def warm_up_plan(engine: LLMEngine) -> tuple[tuple[int, int, int, int, bool], ...]:
    """(step it arrives at, prompt length, tokens to generate, how many such requests, sampled rather than greedy)."""
    cfg, runner = engine.model.config, engine.runner

    def plan(batch, context, rope):
        return decode_plan(batch, context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, runner.dtype,
                           runner.block_size, runner.device, rope)

    # a mixed step's decode (rotated before attention) that the split kernel cuts into parts
    split = next((c for c in range(64, 1 << 16, 64) if plan(1, c, False).splits > 1), 512)
    # a step of short decodes too many for the lean kernel's wave
    wide = next((b for b in range(1, 65) if plan(b, 16, True).kernel == "split"), 64)
    # then, alone, one prompt per tuning bucket of the quantized matmuls past the decode sizes (also the prefill
    # attention's autotuned length buckets): tuned here, not while serving
    alone = tuple((64 + 2 * i, m, 1, 1, False)
                  for i, m in enumerate(m for m in bucket_sizes(engine.config.max_num_batched_tokens) if m > 16))
    return (
        (0, 7, 24, 1, False),  # a short context decoding through every step below (mixed steps)
        (0, split, 24, 1, False),  # the split decode path
        (2, 100, 4, 1, True),  # a mid-length prefill beside the decodes; top-k/top-p sampling
        (4, AUTOTUNE_MIN_TOKENS, 4, 1, False),  # the autotuned prefill bucket
        (6, BUDGET, 2, 1, False),  # a full-budget chunk (and its second chunk, with cached context)
        (8, 3, 4, wide, False),  # a wide decode batch
    ) + alone


def warm_up(engine: LLMEngine, full: bool | None = None) -> int:
    """Run the plan to the end (every request finishes, every block is freed). Returns the number of steps run.
    full: the whole plan (default: on CUDA); else a token-sized run of it, which only checks the path: off the GPU
    there is nothing to compile, and CPU steps are slow."""
    full = engine.runner.device.type == "cuda" if full is None else full
    cfg, bm = engine.config, engine.block_manager
    capacity = bm.num_blocks * bm.block_size
    vocab = engine.model.config.vocab_size
    arrivals, serial = [], 0
    for step, length, new_tokens, count, sampled in warm_up_plan(engine):
        length = cfg.max_num_batched_tokens if length == BUDGET else length
        if not full:
            length, new_tokens, count = min(length, 8), min(new_tokens, 2), min(count, 2)
        length = min(length, engine.max_model_len - new_tokens, capacity - new_tokens)
        if length < 1:
            continue
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                top_p=0.9 if sampled else 1.0, top_k=50 if sampled else 0, seed=serial)
        for _ in range(count):
            ids = [(serial * 7919 + i * 31) % vocab for i in range(length)]  # distinct: no prefix-cache hits
            arrivals.append((step, engine.make_request(f"warm-up-{serial}", ids, params)))
            serial += 1
    if engine.tokenizer is not None:  # a guided request: the grammar library reads the vocabulary here
        params = SamplingParams(max_tokens=4, temperature=0.8, seed=serial,
                                structured_outputs=StructuredOutputsParams(json_object=True))
        arrivals.append((1, engine.make_request(f"warm-up-{serial}", [(serial * 7919) % vocab] * 3, params)))
        arrivals.sort(key=lambda arrival: arrival[0])
    steps, errors, start = 0, set(), engine.num_steps
    while arrivals or engine.has_unfinished_requests():
        if arrivals and not engine.has_unfinished_requests():
            steps = max(steps, arrivals[0][0])  # nothing to run before the next arrival
        while arrivals and arrivals[0][0] <= steps:
            engine.enqueue(arrivals.pop(0)[1])
        errors.update(out.error for out in engine.step() if out.error is not None)
        steps += 1
    if errors:  # the engine survives a failed step, and so does the server: say so, loudly
        log.warning("warm-up steps failed (real requests may fail alike): %s", "; ".join(sorted(errors)))
    return engine.num_steps - start
