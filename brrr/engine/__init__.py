"""The serving engine: paged KV cache, prefix caching, continuous batching with chunked prefill and preemption."""
from brrr.engine.async_llm import AsyncLLM
from brrr.engine.llm import LLM
from brrr.engine.llm_engine import LLMEngine
from brrr.engine.outputs import CompletionOutput, RequestOutput
from brrr.engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "CompletionOutput", "LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
