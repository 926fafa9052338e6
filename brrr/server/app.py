"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health and /metrics, on an AsyncLLM.

A request is validated in full (types, model, sampling fields, prompt + max_tokens against the context) before it
is admitted; admission fails with 429 when --max-waiting requests are already queued. A client that disconnects,
streaming or not, has its engine requests aborted at once, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextlib import aclosing
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from brrr import __version__
from brrr.engine import AsyncLLM, SamplingParams
from brrr.engine.outputs import RequestOutput
from brrr.errors import BrrrError
from brrr.server.metrics import CONTENT_TYPE, ServerMetrics
from brrr.server.middleware import APIKeyAuth, BodySizeLimit
from brrr.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest)
from brrr.server.responses import Formatter, sse, total_usage

log = logging.getLogger("brrr.server")
DEFAULT_MAX_BODY_BYTES = 16 << 20
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


class ClientDisconnected(Exception):
    pass


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
        self.llm, self.engine, self.tokenizer = llm, llm.engine, tokenizer
        self.model_name, self.model_path, self.max_waiting = model_name, model_path, max_waiting
        self.metrics = ServerMetrics(self.engine, model_name)
        self.num_waiting = 0  # admitted engine requests that have not produced an output yet
        self.created = int(time.time())
        bm = self.engine.block_manager
        self.max_total_tokens = min(self.engine.max_model_len, bm.num_blocks * bm.block_size)
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
            raise _as_api_error(e, prompt_field) from None

    def validate(self, request_id: str, ids: list[int], params: SamplingParams, prompt_field: str) -> None:
        try:
            self.engine.make_request(request_id, ids, params)
        except BrrrError as e:
            raise _as_api_error(e, prompt_field) from None

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
        finally:
            if waiting:
                ticket.release()
            tracker.close()


def _as_api_error(e: BrrrError, prompt_field: str) -> APIError:
    message = str(e)
    if "exceeds the model's context" in message or "KV blocks" in message:
        return APIError(400, message, param=prompt_field, code="context_length_exceeded")
    first = re.match(r"[a-z_]+", message)
    param = first.group(0) if first and first.group(0) in SAMPLING_FIELDS else None
    if message.startswith("prompt"):
        param = prompt_field
    return APIError(400, message, param=param)


async def merge(streams):
    """(prompt index, output) from several engine requests, in the order outputs arrive."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(outputs, count: int) -> list[RequestOutput]:
    finals: list = [None] * count
    async with aclosing(outputs) as outs:
        async for i, out in outs:
            if out.finished:
                finals[i] = out
    return finals


async def until_disconnected(request: Request, work_coro):
    """Run work_coro; if the client hangs up first, cancel it (aborting its engine requests) and raise."""
    work = asyncio.ensure_future(work_coro)

    async def hung_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait((work,))
    raise ClientDisconnected()


class EventStream(StreamingResponse):
    """Server-sent events. Whatever ends the response (done, client gone, shutdown) closes the event generator,
    which aborts unfinished engine requests, and gives back unused admission places."""

    def __init__(self, events, ticket: Ticket):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.ticket.release_all()


# ---- the endpoints' streaming bodies ----------------------------------------------------------------------------
async def completion_events(body: CompletionRequest, fmt: Formatter, echo_texts: list[str | None], streams):
    n, sent, finished, finals = body.n, {}, set(), {}
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    first = index not in sent
                    text = c.delta_text
                    reason = c.finish_reason if c.finish_reason and index not in finished else None
                    echo = echo_texts[i] if first and body.echo else None
                    if not (text or reason or echo is not None):
                        continue  # nothing to show yet; these tokens go out with the next text
                    logprobs = None
                    if body.logprobs is not None:
                        start = sent.get(index, 0)
                        logprobs = fmt.completion_logprobs(c.token_ids[start:], c.logprobs[start:])
                        if echo is not None:
                            logprobs = _join(fmt.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs),
                                             logprobs, len(echo))
                    sent[index] = len(c.token_ids)
                    if reason:
                        finished.add(index)
                    choices.append({"index": index, "text": (echo or "") + text, "logprobs": logprobs,
                                    "finish_reason": reason})
                if out.finished:
                    finals[i] = out
                if choices:
                    yield sse(fmt.completion_chunk(choices))
        if body.include_usage:
            yield sse(fmt.completion_chunk([], total_usage(list(finals.values()))))
    except APIError as e:
        yield sse(e.body())
    yield sse("[DONE]")


def _join(prompt_lp: dict, output_lp: dict, offset: int) -> dict:
    """Echoed prompt logprobs followed by the completion's, text offsets continuing after the prompt."""
    return {"tokens": prompt_lp["tokens"] + output_lp["tokens"],
            "token_logprobs": prompt_lp["token_logprobs"] + output_lp["token_logprobs"],
            "top_logprobs": prompt_lp["top_logprobs"] + output_lp["top_logprobs"],
            "text_offset": prompt_lp["text_offset"] + [o + offset for o in output_lp["text_offset"]]}


async def chat_events(body: ChatCompletionRequest, fmt: Formatter, top_logprobs: int | None, stream):
    n, sent, finished, final = body.n, {}, set(), None
    yield sse(fmt.chat_chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None} for j in range(n)]))
    try:
        async with aclosing(merge([stream])) as outputs:
            async for _, out in outputs:
                choices = []
                for c in out.outputs:
                    reason = c.finish_reason if c.finish_reason and c.index not in finished else None
                    if not (c.delta_text or reason):
                        continue
                    logprobs = None
                    if top_logprobs is not None:
                        start = sent.get(c.index, 0)
                        logprobs = fmt.chat_logprobs(c.token_ids[start:], c.logprobs[start:], top_logprobs)
                    sent[c.index] = len(c.token_ids)
                    if reason:
                        finished.add(c.index)
                    choices.append({"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                    "logprobs": logprobs, "finish_reason": reason})
                final = out
                if choices:
                    yield sse(fmt.chat_chunk(choices))
        if body.include_usage:
            yield sse(fmt.chat_chunk([], total_usage([final] if final else [])))
    except APIError as e:
        yield sse(e.body())
    yield sse("[DONE]")


# ---- the app ------------------------------------------------------------------------------------------------------
def create_app(llm: AsyncLLM, tokenizer, model_name: str, *, model_path: str | Path | None = None,
               api_key: str | None = None, max_waiting: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server on an AsyncLLM the caller owns (and shuts down). api_key: required as a Bearer token on every
    path but /health and /metrics. max_waiting: admitted requests without output yet before 429s (None: no cap)."""
    state = ServerState(llm, tokenizer, model_name, str(model_path) if model_path else None, max_waiting)
    app = FastAPI(title="brrr", version=__version__,
                  description="OpenAI-compatible completions and chat on brrr's engine.")
    app.state.brrr = state
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key)  # added last = outermost: a 401 comes before a 413
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "brrr",
                "root": state.model_path, "max_model_len": state.engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (text) or 'messages' (chat)", param="prompt")
        try:
            if body.prompt is not None:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                messages = ChatCompletionRequest(messages=body.messages).template_messages()
                ids = tokenizer.encode_chat(messages, body.add_generation_prompt)
        except BrrrError as e:
            raise APIError(400, str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.check_request(body)
        if isinstance(body.prompt, str):
            prompts = [body.prompt]
        elif not body.prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        elif isinstance(body.prompt[0], int):
            prompts = [body.prompt]
        else:
            prompts = list(body.prompt)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        k = body.logprobs
        jobs, echo_texts = [], []
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            max_tokens = body.max_tokens if body.max_tokens is not None else state.default_max_tokens(len(ids))
            params = state.sampling_params(body, max_tokens, k, k if body.echo and k is not None else None, "prompt")
            state.validate(f"{response_id}-{i}", ids, params, "prompt")
            jobs.append((f"{response_id}-{i}", ids, params))
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else
                                  tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens))
            else:
                echo_texts.append(None)
        ticket = state.admit(len(jobs))
        fmt = state.formatter(response_id)
        streams = [state.stream(ids, params, job_id, ticket) for job_id, ids, params in jobs]
        if body.stream:
            return EventStream(completion_events(body, fmt, echo_texts, streams), ticket)
        try:
            finals = await until_disconnected(request, final_outputs(merge(streams), len(streams)))
        finally:
            ticket.release_all()
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None
                if k is not None:
                    logprobs = fmt.completion_logprobs(c.token_ids, c.logprobs)
                    if body.echo:
                        logprobs = _join(fmt.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs),
                                         logprobs, len(echo_texts[i]))
                choices.append(fmt.completion_choice(i * body.n + c.index, c, echo_texts[i], logprobs))
        return JSONResponse(fmt.completion(choices, total_usage(finals)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_request(body)
        try:
            ids = tokenizer.encode_chat(body.template_messages(), body.add_generation_prompt)
        except BrrrError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = state.default_max_tokens(len(ids))
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = state.sampling_params(body, max_tokens, k, None, "messages")
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        state.validate(response_id, ids, params, "messages")
        ticket = state.admit(1)
        fmt = state.formatter(response_id)
        stream = state.stream(ids, params, response_id, ticket)
        if body.stream:
            return EventStream(chat_events(body, fmt, k, stream), ticket)
        try:
            (out,) = await until_disconnected(request, final_outputs(merge([stream]), 1))
        finally:
            ticket.release_all()
        choices = [fmt.chat_choice(c.index, c, None if k is None else fmt.chat_logprobs(c.token_ids, c.logprobs, k))
                   for c in out.outputs]
        return JSONResponse(fmt.chat(choices, total_usage([out])))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(BrrrError)
    async def brrr_error(request, e: BrrrError):
        error = _as_api_error(e, "prompt")
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        error = _validation_error(e.errors())
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        error = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request, e):
        return Response(status_code=499)  # nobody is listening; nginx's code for it, for the access log

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error: {type(e).__name__}: {e}")
        return JSONResponse(error.body(), status_code=500)


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _validation_error(errors) -> APIError:
    """pydantic's first complaint as one OpenAI error, naming the field path (messages.0.content, max_tokens)."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    def field_path(error):
        return ".".join(str(p) for p in error["loc"][1:] if not (isinstance(p, str) and _UNION_TAG.match(p)))

    param = field_path(first)
    if not param:
        if first["type"] == "missing":
            return APIError(400, "request body is missing: send a JSON object", code="invalid_request")
        if isinstance(first.get("input"), bytes):
            return APIError(400, "request body must be JSON, sent with 'Content-Type: application/json'",
                            code="invalid_request")
        return APIError(400, f"request body must be a JSON object: {first['msg']}", code="invalid_request")
    if first["type"] == "missing":
        return APIError(400, f"{param}: Field required", param=param, code="missing_field")
    # a union field (prompt, stop, content) fails once per accepted type: say what each wanted
    wanted = list(dict.fromkeys(e["msg"] for e in errors if field_path(e).startswith(param)
                                and len(e["loc"]) - len(first["loc"]) <= 1))
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    wants = " or ".join(wanted).replace(" or Input should be ", " or ")
    return APIError(400, f"{param}: {wants}, got {got}", param=param, code="invalid_type")
