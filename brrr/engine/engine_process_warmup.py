"""Warm-up: a few requests through the engine before the server says it is ready, so that first-call costs are paid
here and not by the first users. On a GPU the large one is Triton compiling (and, for long prefill chunks,
autotuning) kernels the first time they meet a new specialization: the H200 run without warm-up had p99 TTFT of
1-1.7 s at 4 req/s, in the first run after start-up only.

What varies between compilations: the prefill kernel's length bucket (next power of two of the longest new chunk:
under 16, up to 1023 and >= 1024 are different kernels, and 16-bit chunks of >= 1024 tokens are autotuned per
bucket); whether the split-KV decode kernel splits (contexts over 512 keys at small batch) or not (wide batches);
decodes inside mixed prefill steps, which run eagerly, outside the CUDA graphs. The plan below meets each once.
"""
from __future__ import annotations

import logging

from brrr.engine.llm_engine import LLMEngine
from brrr.engine.sampling_params import SamplingParams

log = logging.getLogger("brrr.engine")
BUDGET = -1  # a prompt as long as the step's token budget
# (step it arrives at, prompt length, tokens to generate, how many such requests, sampled rather than greedy)
PLAN = (
    (0, 7, 24, 1, False),  # a short context decoding through every step below (mixed steps)
    (0, 600, 24, 1, False),  # a context over 512 keys: the split-KV decode path
    (2, 100, 4, 1, True),  # a mid-length prefill beside the decodes; top-k/top-p sampling
    (4, 1100, 4, 1, False),  # >= 1024 new tokens: the autotuned prefill bucket
    (6, BUDGET, 2, 1, False),  # a full-budget chunk (and its second chunk, with cached context)
    (8, 3, 4, 24, False),  # a wide decode batch
)




def warm_up(engine: LLMEngine, full: bool | None = None) -> int:
    """Run the plan to the end (every request finishes, every block is freed). Returns the number of steps.
    full: the whole plan (default: on CUDA); else a token-sized run of it, which only checks the path: off the GPU
    there is nothing to compile, and CPU steps are slow."""
    full = engine.runner.device.type == "cuda" if full is None else full
    cfg, bm = engine.config, engine.block_manager
    capacity = bm.num_blocks * bm.block_size
    vocab = engine.model.config.vocab_size
    arrivals, serial = [], 0
    for step, length, new_tokens, count, sampled in PLAN:
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
    steps, errors = 0, set()
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= steps:
            engine.enqueue(arrivals.pop(0)[1])
        errors.update(out.error for out in engine.step() if out.error is not None)
        steps += 1
    if errors:  # the engine survives a failed step, and so does the server: say so, loudly
        log.warning("warm-up steps failed (real requests may fail alike): %s", "; ".join(sorted(errors)))
    return steps
