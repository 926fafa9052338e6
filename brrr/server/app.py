"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health and /metrics, on an AsyncLLM; with LoRA, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
(lora_adapters.py), and "model" naming an adapter.

A request is validated in full (types, model, sampling fields, prompt + max_tokens against the context) before it
is admitted; admission fails with 429 when --max-waiting requests are already queued. A client that disconnects,
streaming or not, has its engine requests aborted at once, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from brrr import __version__
from brrr.engine import AsyncLLM
from brrr.errors import BrrrError
from brrr.server.metrics import CONTENT_TYPE
from brrr.server.middleware import APIKeyAuth, BodySizeLimit
from brrr.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest, as_api_error,
                                  template_messages, template_tools, validation_error)
from brrr.server.responses import best_samples, prompt_only, total_usage
from brrr.server.state import ServerState, close_all
from brrr.server.streams import (ClientDisconnected, EventStream, chat_events, completion_events, final_outputs,
                                 join_logprobs, merge, until_disconnected)
from brrr.server.structured import request_constraint, tool_use
from brrr.server.tool_parsers import TOOL_FORMATS, ToolFormat, detect_tool_format

log = logging.getLogger("brrr.server")
DEFAULT_MAX_BODY_BYTES = 16 << 20


def create_app(llm: AsyncLLM, tokenizer, model_name: str, *, model_path: str | Path | None = None,
               api_key: str | None = None, max_waiting: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False, lora_modules: list[tuple[str, str]] | None = None,
               runtime_lora: bool = False, lora_dirs: list[str] | None = None) -> FastAPI:
    """The server on an AsyncLLM the caller owns (and shuts down). api_key: required as a Bearer token on every
    path but /health and /metrics. max_waiting: admitted requests without output yet before 429s (None: no cap).
    tool_call_parser: how the model writes tool calls (hermes, llama3_json; None: read from the chat template).
    enable_auto_tool_choice: tool_choice "auto" reads tool calls out of the model's free reply. lora_modules:
    (name, path) adapters served from the start (the engine must serve LoRA); a bad one raises BrrrError.
    runtime_lora: clients may load and unload adapters (vLLM's endpoints), from inside lora_dirs when given."""
    state = ServerState(llm, tokenizer, model_name, str(model_path) if model_path else None, max_waiting,
                        tool_format(tokenizer, tool_call_parser, enable_auto_tool_choice), enable_auto_tool_choice,
                        runtime_lora, lora_dirs)
    for name, path in lora_modules or ():
        llm.add_lora(state.adapters.load(name, path)[0])
    app = FastAPI(title="brrr", version=__version__,
                  description="OpenAI-compatible completions and chat on brrr's engine.")
    app.state.brrr = state
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key)  # added last = outermost: a 401 comes before a 413
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if not llm.healthy:  # the engine is gone (or stopping): load balancers and orchestrators should know
            return JSONResponse({"status": "unhealthy", "reason": llm.failure or "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "brrr",
                "root": state.model_path, "parent": None, "max_model_len": llm.max_model_len}
        adapters = [{"id": lora.lora_name, "object": "model", "created": state.created, "owned_by": "brrr",
                     "root": lora.lora_path, "parent": model_name, "max_model_len": llm.max_model_len}
                    for lora in state.adapters.served.values()]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        state.adapters.check_runtime_update(body.lora_path)
        try:  # reads the adapter's files: off the event loop
            lora, replaced = await asyncio.to_thread(state.adapters.load, body.lora_name, body.lora_path,
                                                     body.load_inplace)
        except BrrrError as e:
            raise APIError(400, str(e), param="lora_path" if "lora_name" not in str(e) else "lora_name") from None
        if replaced is not None:
            llm.remove_lora(replaced.lora_int_id)
        llm.add_lora(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        state.adapters.check_runtime_update()
        lora = state.adapters.unload(body.lora_name)
        llm.remove_lora(lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-eval's tokenizer_backend=remote reads the
        special tokens here, then tokenizes through /tokenize)."""
        special = tokenizer.special_tokens
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": llm.max_model_len,
                "vocab_size": tokenizer.vocab_size, "chat_template": tokenizer.chat_template,
                **{key: special.get(key) for key in ("eos_token", "bos_token", "pad_token", "unk_token")}}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (text) or 'messages' (chat)", param="prompt")
        try:
            if body.prompt is not None:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                ids = tokenizer.encode_chat(template_messages(body.messages), body.add_generation_prompt,
                                            template_tools(body.tools))
        except BrrrError as e:
            raise APIError(400, str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

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
        lora = state.check_request(body)
        constraint = request_constraint(body)
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
        best_of = body.num_candidates if body.num_candidates > body.n else None
        engine_k = 0 if best_of and k is None else k  # best_of ranks samples by their tokens' logprobs
        jobs, echo_texts = [], []
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            # scoring only: the engine draws one token, which the response leaves out
            max_tokens = 1 if body.scoring_only else state.max_tokens(body, len(ids))
            params = state.sampling_params(body, max_tokens, engine_k, k if body.echo and k is not None else None,
                                           "prompt", constraint, n=body.num_candidates)
            jobs.append(state.validate(f"{response_id}-{i}", ids, params, "prompt", constraint, lora))
            if body.echo:
                echo_texts.append(prompt if isinstance(prompt, str) else
                                  tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens))
            else:
                echo_texts.append(None)
        ticket = state.admit(len(jobs))
        fmt = state.formatter(response_id, lora)
        streams = state.submit(jobs, ticket)
        if body.stream:
            return EventStream(completion_events(body, fmt, echo_texts, streams), ticket, streams)
        try:
            finals = await until_disconnected(request, final_outputs(merge(streams), len(streams)))
        finally:
            close_all(streams)
            ticket.release_all()
        if body.scoring_only:
            finals = [prompt_only(out) for out in finals]
        usage = total_usage(finals)  # every sample drawn counts, best_of's discarded ones too
        choices = []
        for i, out in enumerate(finals):
            for c in (best_samples(out.outputs, body.n) if best_of else out.outputs):
                logprobs = None
                if k is not None:
                    logprobs = fmt.completion_logprobs(c.token_ids, c.logprobs)
                    if body.echo:
                        logprobs = join_logprobs(fmt.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs),
                                         logprobs, len(echo_texts[i]))
                choices.append(fmt.completion_choice(i * body.n + c.index, c, echo_texts[i], logprobs))
        return JSONResponse(fmt.completion(choices, usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = state.check_request(body)
        tools = tool_use(body, state.tool_format, state.auto_tool_choice)
        constraint = request_constraint(body, tools)
        if tools is not None and tools.keeps_special_tokens:
            body.skip_special_tokens = False  # as vLLM does for hermes: the parser must see the call markers
        try:
            prompt = tokenizer.apply_chat_template(body.template_messages(), body.add_generation_prompt,
                                                   tools=body.template_tools())
        except BrrrError as e:
            raise APIError(400, str(e), param="messages") from None
        if tools is not None:  # a forced call in the model's format: its opening; the constraint does the rest
            prompt += tools.opening
        ids = tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote the special tokens
        max_tokens = state.max_tokens(body, len(ids))
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = state.sampling_params(body, max_tokens, k, None, "messages", constraint)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = state.validate(response_id, ids, params, "messages", constraint, lora)
        ticket = state.admit(1)
        fmt = state.formatter(response_id, lora)
        streams = state.submit([job], ticket)
        if body.stream:
            return EventStream(chat_events(body, fmt, k, streams[0], tools), ticket, streams)
        try:
            (out,) = await until_disconnected(request, final_outputs(merge(streams), 1))
        finally:
            close_all(streams)
            ticket.release_all()
        choices = [fmt.chat_choice(c.index, c, None if k is None else fmt.chat_logprobs(c.token_ids, c.logprobs, k),
                                   tools.parser() if tools else None) for c in out.outputs]
        return JSONResponse(fmt.chat(choices, total_usage([out])))

    # Starlette tries routes in order, a regex each: the generation endpoints first, ahead of FastAPI's docs routes
    hot = ("/v1/completions", "/v1/chat/completions")
    app.router.routes.sort(key=lambda route: getattr(route, "path", "") not in hot)
    return app



def tool_format(tokenizer, parser: str | None, auto_tool_choice: bool) -> ToolFormat | None:
    """The tool-call format: the one named, else the chat template's (None: not one brrr knows)."""
    if parser is not None:
        if parser not in TOOL_FORMATS:
            raise BrrrError(f"--tool-call-parser must be one of {', '.join(TOOL_FORMATS)}, got {parser!r}")
        return TOOL_FORMATS[parser]
    found = detect_tool_format(tokenizer.chat_template)
    if found is None and auto_tool_choice:
        raise BrrrError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json): the chat "
                        "template does not show a tool-call format brrr knows")
    return found


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(BrrrError)
    async def brrr_error(request, e: BrrrError):
        error = as_api_error(e, "prompt")
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        error = validation_error(e.errors())
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

