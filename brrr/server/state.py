"""Server state: the engine, the tokenizer and the served name; request validation and admission (the --max-waiting
queue cap); and `stream`, one engine request's outputs with metrics observed and the admission place given back."""
from __future__ import annotations

import logging
import time
from contextlib import aclosing
from functools import lru_cache

from brrr.engine import AsyncLLM, SamplingParams
from brrr.errors import BrrrError
from brrr.server.metrics import ServerMetrics
from brrr.server.protocol import APIError, as_api_error
from brrr.server.responses import Formatter

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
    def __init__(self, llm: AsyncLLM, tokenizer, model_name: str, model_path: str | None, max_waiting: int | None):
        self.llm, self.tokenizer = llm, tokenizer
        self.model_name, self.model_path, self.max_waiting = model_name, model_path, max_waiting
        self.metrics = ServerMetrics(llm, model_name)
        self.num_waiting = 0  # admitted engine requests that have not produced an output yet
        self.created = int(time.time())
        info = llm.info
        self.max_total_tokens = min(info.max_model_len, info.num_blocks * info.block_size)
        self.token_text = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.token_width = lru_cache(maxsize=1 << 16)(lambda t: len(tokenizer.decode([t], skip_special_tokens=True)))

    def formatter(self, response_id: str) -> Formatter:
        return Formatter(response_id, self.model_name, int(time.time()), self.token_text, self.token_width)

    # ---- validation and admission -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_request(self, body) -> None:
        self.check_model(body.model)
        for field, why in body.unsupported():
            raise APIError(400, why, param=field, code="unsupported_parameter")
        if body.model_extra:
            log.warning("ignoring unknown request fields: %s", ", ".join(sorted(body.model_extra)))

    def sampling_params(self, body, max_tokens: int, logprobs, prompt_logprobs, prompt_field: str) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except BrrrError as e:
            raise as_api_error(e, prompt_field) from None

    def validate(self, request_id: str, ids: list[int], params: SamplingParams, prompt_field: str) -> None:
        try:
            self.llm.make_request(request_id, ids, params)
        except BrrrError as e:
            raise as_api_error(e, prompt_field) from None

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.max_total_tokens - prompt_len)

    def admit(self, count: int) -> Ticket:
        if self.max_waiting is not None and self.num_waiting + count > self.max_waiting:
            raise APIError(429, f"the server is at capacity: {self.num_waiting} requests are waiting and the limit "
                           f"is {self.max_waiting} (--max-waiting); retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})
        return Ticket(self, count)

    # ---- generation -------------------------------------------------------------------------------------------
    async def stream(self, ids: list[int], params: SamplingParams, request_id: str, ticket: Ticket):
        """One engine request's outputs. Closing this generator early aborts the request (AsyncLLM frees its
        KV blocks)."""
        tracker, waiting = self.metrics.request_tracker(), True
        try:
            async with aclosing(self.llm.generate(ids, params, request_id)) as outputs:
                async for out in outputs:
                    if waiting:
                        waiting = False
                        ticket.release()
                    tracker.observe(out)
                    if out.error is not None:
                        raise APIError(500, f"generation failed: {out.error}", code="engine_error")
                    yield out
        except BrrrError as e:  # validated already, so: the engine is shutting down, or gone
            raise APIError(503, str(e), code="unavailable") from None
        finally:
            if waiting:
                ticket.release()
            tracker.close()

