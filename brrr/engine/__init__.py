"""The serving engine: paged KV cache, prefix caching, continuous batching with chunked prefill and preemption."""
from brrr.engine.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
