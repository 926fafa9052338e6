"""`LLMEngine`: an engine core and the output processor in one process, whose steps give `RequestOutput`s (what
`LLM`, the CLI and tests drive). The core is any `EngineCore` (a disaggregated one included): composition, so the
engine process, which runs a core alone, and this class share one core without rebinding its methods."""
from __future__ import annotations

from brrr.config import EngineConfig
from brrr.engine.core import EngineCore
from brrr.engine.output_processor import OutputProcessor
from brrr.engine.outputs import RequestOutput
from brrr.sampling_params import SamplingParams
from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.sequence import Request
from brrr.lora.serving import LoRARequest


class LLMEngine:
    def __init__(self, model=None, tokenizer=None, config: EngineConfig | None = None, eos_token_ids=(),
                 core: EngineCore | None = None):
        """Builds an EngineCore over model (or wraps `core`, already built)."""
        self.core = core if core is not None else EngineCore(model, tokenizer, config, eos_token_ids)
        self.processor = OutputProcessor(self.core.tokenizer)

    def __getattr__(self, name):
        # everything but requests in and outputs out is the core's (scheduler, runner, stats, adapters, ...)
        if name == "core":  # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.core, name)

    def __setattr__(self, name, value):
        if name in ("core", "processor"):
            object.__setattr__(self, name, value)
        else:  # the core's, as reading it is
            setattr(self.core, name, value)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, stream: bool = True,
                    lora_request: LoRARequest | None = None) -> Request:
        """stream: an output each step the request progresses in; else only its final one."""
        return self.enqueue(self.core.make_request(request_id, prompt, params, lora_request), stream)

    def enqueue(self, request: Request, stream: bool = True) -> Request:
        self.core.enqueue(request)
        self.processor.add_request(request, stream)
        return request

    def abort(self, request_id: str, index: int | None = None) -> bool:
        if index is None:
            self.processor.abort(request_id)
        return self.core.abort(request_id, index)

    def step(self, batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        processed = self.processor.process(self.core.step(batch))
        for request_id, index in processed.stopped:  # stop strings: the engine drops those samples now
            self.core.abort(request_id, index)
        return processed.outputs
