"""Server state: the engine, the tokenizer and the served name; request validation and admission (the --max-waiting
queue cap); and `submit`: engine requests queued from the handler, each a ServedStream of outputs with metrics
observed and the admission place given back."""
from __future__ import annotations

import logging
import time
from functools import lru_cache

from brrr.engine import AsyncLLM
from brrr.engine.sequence import Request
from brrr.errors import BrrrError
from brrr.lora.serving import LoRARequest
from brrr.sampling_params import SamplingParams
from brrr.server.lora_adapters import LoraAdapters
from brrr.server.metrics import ServerMetrics
from brrr.server.protocol import APIError, as_api_error
from brrr.server.responses import Formatter
from brrr.server.structured import Constraint
from brrr.server.tool_parsers import ToolFormat

log = logging.getLogger("brrr.server")


class Ticket:
    """An HTTP request's places in the admission queue, one per engine request; each is given back at that engine
    request's first output or when it ends, whichever comes first."""

    def __init__(self, state: "ServerState", count: int):
        self.state, self.left = state, count
        state.num_waiting += count

    def release(self, count: int = 1) -> None:
        count = min(count, self.left)
        self.left -= count
        self.state.num_waiting -= count

    def release_all(self) -> None:
        self.release(self.left)


class ServerState:
    def __init__(self, llm: AsyncLLM, tokenizer, model_name: str, model_path: str | None, max_waiting: int | None,
                 tool_format: ToolFormat | None = None, auto_tool_choice: bool = False, runtime_lora: bool = False,
                 lora_dirs: list[str] | None = None):
        self.llm, self.tokenizer = llm, tokenizer
        # how the model writes tool calls (None: unknown) and whether "auto" reads calls out of free replies
        self.tool_format, self.auto_tool_choice = tool_format, auto_tool_choice
        self.model_name, self.model_path, self.max_waiting = model_name, model_path, max_waiting
        self.metrics = ServerMetrics(llm, model_name)
        self.adapters = LoraAdapters(llm, model_name, runtime_lora, lora_dirs)
        self.num_waiting = 0  # admitted engine requests that have not produced an output yet
        self.created = int(time.time())
        info = llm.info
        self.max_total_tokens = min(info.max_model_len, info.num_blocks * info.block_size)
        self.token_text = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.token_width = lru_cache(maxsize=1 << 16)(lambda t: len(tokenizer.decode([t], skip_special_tokens=True)))

    def formatter(self, response_id: str, lora: LoRARequest | None = None) -> Formatter:
        """Responses name the model the request asked for: the base, or the adapter."""
        model = self.model_name if lora is None else lora.lora_name
        return Formatter(response_id, model, int(time.time()), self.token_text, self.token_width)

    # ---- validation and admission -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base); 404 for a name this server does not serve."""
        return self.adapters.resolve(model)

    def check_request(self, body) -> LoRARequest | None:
        lora = self.check_model(body.model)
        for field, why in body.unsupported():
            raise APIError(400, why, param=field, code="unsupported_parameter")
        if body.model_extra:
            log.warning("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))
        return lora

    def sampling_params(self, body, max_tokens: int, logprobs, prompt_logprobs, prompt_field: str,
                        constraint: Constraint | None = None, n: int | None = None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs,
                                        constraint.params if constraint else None, n)
        except BrrrError as e:
            raise (constraint and constraint.error(e)) or as_api_error(e, prompt_field) from None

    def validate(self, request_id: str, ids: list[int], params: SamplingParams, prompt_field: str,
                 constraint: Constraint | None = None, lora: LoRARequest | None = None) -> Request:
        """The engine's checks, a schema or regex compiled among them: a BrrrError becomes a 400 naming the field."""
        try:
            return self.llm.make_request(request_id, ids, params, lora)
        except BrrrError as e:
            raise (constraint and constraint.error(e)) or as_api_error(e, prompt_field) from None

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.max_total_tokens - prompt_len)

    def max_tokens(self, body, prompt_len: int) -> int:
        """The request's token cap (the context's rest when it sets none); a cap no prompt could fit under is a
        400 naming the cap's field, not the prompt."""
        requested = body.requested_max_tokens
        if requested is None:
            return self.default_max_tokens(prompt_len)
        if requested > self.max_total_tokens:
            field = body.request_field("max_tokens")
            room = (f"the model's context of {self.max_total_tokens} tokens"
                    if self.max_total_tokens == self.llm.max_model_len else
                    f"the {self.max_total_tokens} tokens the KV cache holds (context {self.llm.max_model_len})")
            raise APIError(400, f"{field} ({requested}) exceeds {room}", param=field, code="context_length_exceeded")
        return requested

    def admit(self, count: int) -> Ticket:
        if self.max_waiting is not None and self.num_waiting + count > self.max_waiting:
            raise APIError(429, f"the server is at capacity: {self.num_waiting} requests are waiting and the limit "
                           f"is {self.max_waiting} (--max-waiting); retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})
        return Ticket(self, count)

    # ---- generation -------------------------------------------------------------------------------------------
    def submit(self, requests: list[Request], ticket: Ticket) -> list["ServedStream"]:
        """Queue validated requests in the engine now (not when the response starts streaming: under a burst that
        is after every other request's handler has run). The caller closes what this returns."""
        streams = []
        try:
            for request in requests:
                streams.append(ServedStream(self, self.llm.submit(request), ticket))
        except BrrrError as e:  # validated already, so: the engine is shutting down, or gone
            close_all(streams)
            raise APIError(503, str(e), code="unavailable") from None
        return streams


class ServedStream:
    """One queued engine request's outputs (an async iterator) with metrics observed and its admission place given
    back at its first output. close() (or aclose()) aborts it unless it finished, iterated or not."""

    def __init__(self, state: ServerState, outputs, ticket: Ticket):
        self.outputs, self.ticket = outputs, ticket
        self.tracker, self.waiting, self.closed = state.metrics.request_tracker(), True, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self.outputs.__anext__()
        if self.waiting:
            self.waiting = False
            self.ticket.release()
        self.tracker.observe(out)
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}", code="engine_error")
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outputs.close()
            if self.waiting:
                self.ticket.release()
            self.tracker.close()

    async def aclose(self) -> None:
        self.close()


def close_all(streams) -> None:
    for stream in streams:
        stream.close()
