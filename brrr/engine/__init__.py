"""The serving engine: paged KV cache, prefix caching, continuous batching with chunked prefill and preemption."""
from brrr.engine.async_llm import AsyncLLM
from brrr.engine.llm import LLM
from brrr.engine.core import EngineCore
from brrr.engine.llm_engine import LLMEngine
from brrr.engine.output_processor import OutputProcessor
from brrr.engine.outputs import CompletionOutput, EngineOutput, RequestOutput
from brrr.lora.serving import LoRARequest

__all__ = ["AsyncLLM", "CompletionOutput", "EngineCore", "EngineOutput", "LLM", "LLMEngine", "LoRARequest",
           "OutputProcessor", "RequestOutput"]
