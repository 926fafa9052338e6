"""The OpenAI request bodies brrr accepts, as pydantic models, and how each becomes engine SamplingParams.

Types are strict (a string where a number belongs is a 400, not a silent cast). Fields nobody knows are ignored
(and logged), the way OpenAI-compatible servers treat them; fields OpenAI defines but brrr cannot honour (suffix,
functions, audio, ...) are refused with a 400 naming them, so no caller believes they took effect. Extra fields use
vLLM's names (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, structured_outputs, guided_json, ...).
Constraints (response_format, structured_outputs, guided_*, forced tool calls) become engine params in
structured.py.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from brrr.sampling_params import LOGIT_BIAS_LIMIT
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
             404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _characters(text: str) -> str:
    """A lone surrogate ("\\ud800" is valid JSON) is not a character: no tokenizer encodes it, no reply can echo it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"contains a lone UTF-16 surrogate at character {e.start}, which is not a character; "
                             "send text as UTF-8, or surrogates only in pairs") from None
    return text


Text = Annotated[str, AfterValidator(_characters)]  # every string that is tokenized or echoed back
ROLES = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (guidellm and aiperf ask for it)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # brrr always enforces the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one of these."""
    model_config = ConfigDict(strict=True, extra="allow")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None  # None: the one model this server serves
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in OpenAI's [-100, 100]
    user: str | None = None  # accepted and unused: it only labels the caller
    response_format: ResponseFormat | None = None
    # vLLM-style constraints
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to something brrr would otherwise have to drop."""
        bad = []
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options is only allowed when stream is true"))
        return bad

    def request_field(self, sampling_field: str) -> str:
        """The request field a SamplingParams field came from (what an error must name)."""
        return sampling_field

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs=None, n: int | None = None) -> SamplingParams:
        """Raises APIError (400) naming the request field when a value is out of range. n: samples to draw when
        that is not the request's n (best_of)."""
        def pick(value, default):
            return default if value is None else value

        for token, bias in (self.logit_bias or {}).items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # OpenAI refuses these too (the engine clamps)
                raise APIError(400, f"logit_bias[{token}] must be in [-100, 100], got {bias}",
                               param=f"logit_bias.{token}", code="invalid_value")

        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=pick(self.temperature, 1.0),
                top_k=pick(self.top_k, 0), top_p=pick(self.top_p, 1.0), min_p=pick(self.min_p, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0), seed=self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                n=self.n if n is None else n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens, structured_outputs=structured_outputs,
                logit_bias=self.logit_bias)
        except BrrrError as e:
            if str(e).startswith("structured_outputs"):
                raise  # the caller knows which body field the constraint came from
            error = as_api_error(e, "prompt")
            name = self.request_field(error.param) if error.param else None
            if name != error.param:  # "logprobs must be ..." -> "top_logprobs must be ..."
                error.message, error.param = re.sub(rf"\b{error.param}\b", name, error.message, count=1), name
            raise error from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk. vLLM honours it only beside include_usage; brrr does not drop it alone."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Request):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; an explicit null means "up to the context"; 0 with echo scores
    max_completion_tokens: int | None = None  # the chat name, which benchmark clients send here too
    echo: bool = False
    logprobs: int | None = None  # top-k per token, 0 = only the chosen token's
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self):
        bad = super().unsupported()
        if self.suffix:
            bad.append(("suffix", "suffix (insertion) is not supported"))
        if self.best_of is not None and self.best_of < self.n:
            bad.append(("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})"))
        elif self.stream and self.num_candidates > self.n:
            bad.append(("best_of", "best_of cannot be used with stream: the best samples are known only at the end"))
        if self.requested_max_tokens == 0:
            if not self.echo:
                bad.append((self.max_tokens_field, f"{self.max_tokens_field} must be >= 1, or 0 with echo (a "
                            "request that only scores its prompt)"))
            elif self.num_candidates > 1 or self.min_tokens:
                bad.append((self.max_tokens_field, f"{self.max_tokens_field} 0 (scoring only) draws no samples: "
                            "n, best_of and min_tokens must be left at their defaults"))
        return bad

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def scoring_only(self) -> bool:
        """max_tokens 0 with echo: the prompt's logprobs, no completion (lm-eval's loglikelihood requests)."""
        return self.requested_max_tokens == 0 and self.echo

    @property
    def num_candidates(self) -> int:
        """Samples to draw: best_of (the n best are returned), else n."""
        return self.n if self.best_of is None else self.best_of

    def request_field(self, sampling_field: str) -> str:
        if sampling_field == "max_tokens":
            return self.max_tokens_field
        return "best_of" if sampling_field == "n" and self.num_candidates > self.n else sampling_field


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Text | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Text
    arguments: Text  # JSON text, as the server returned it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: ROLES
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: which call it answers


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # brrr always enforces the schema of a forced call


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionName


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as a chat template expects them: role and plain-text content (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}] has type {part.type!r}; only text parts "
                                   "are supported", param=f"messages.{i}.content.{j}.type")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        out.append(message)
    return out


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the client sent them (chat templates read them as transformers passes them)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _template_call(call: MessageToolCall) -> dict:
    """A call as templates render it (and as vLLM hands it to them): arguments as an object, not JSON text."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced call is one call; "auto" lets the model make several
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None

    def unsupported(self):
        bad = super().unsupported()
        for name in ("functions", "audio", "prediction"):
            if getattr(self, name):
                bad.append((name, f"{name} is not supported" + (": use tools" if name == "functions" else "")))
        if self.function_call not in (None, "none"):
            bad.append(("function_call", "function_call is not supported: use tool_choice"))
        if self.modalities and self.modalities != ["text"]:
            bad.append(("modalities", "only the text modality is supported"))
        if self.top_logprobs is not None and not self.logprobs:
            bad.append(("top_logprobs", "top_logprobs needs logprobs to be true"))
        return bad

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict] | None:
        return template_tools(self.tools)

    def request_field(self, sampling_field: str) -> str:
        if sampling_field == "logprobs":
            return "top_logprobs"
        if sampling_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return sampling_field

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # rendered by the chat template with the messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):  # vLLM's POST /v1/load_lora_adapter
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the adapter already served under this name


class UnloadLoRAAdapterRequest(BaseModel):  # vLLM's POST /v1/unload_lora_adapter
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def as_api_error(e: BrrrError, prompt_field: str) -> APIError:
    """A BrrrError from validation as a 400, its param guessed from the field the message starts with."""
    message = str(e)
    if "exceeds the model's context" in message or "KV blocks" in message:
        return APIError(400, message, param=prompt_field, code="context_length_exceeded")
    first = re.match(r"[a-z_]+", message)
    param = first.group(0) if first and first.group(0) in SAMPLING_FIELDS else None
    if message.startswith("prompt"):
        param = prompt_field
    return APIError(400, message, param=param)


_UNION_TAG = re.compile(r"^(str|int|float|bool|literal\[.*\]|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|[A-Z]\w*)$")


def _field_path(error) -> str:
    """pydantic's location without the leading "body" and the union-branch tags: messages.0.content."""
    return ".".join(str(p) for p in error["loc"][1:] if not (isinstance(p, str) and _UNION_TAG.match(p)))


def validation_error(errors) -> APIError:
    """pydantic's first complaint as one OpenAI error, naming the field path (messages.0.content, max_tokens)."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    param = _field_path(first)
    if not param:
        if first["type"] == "missing":
            return APIError(400, "request body is missing: send a JSON object", code="invalid_request")
        if isinstance(first.get("input"), bytes):
            return APIError(400, "request body must be JSON, sent with 'Content-Type: application/json'",
                            code="invalid_request")
        return APIError(400, f"request body must be a JSON object: {first['msg']}", code="invalid_request")
    if first["type"] == "missing":
        return APIError(400, f"{param}: Field required", param=param, code="missing_field")
    # a value of the right type that a validator refused (a lone surrogate): its reason, not the union's types
    refused = next((e for e in errors if e["type"] == "value_error" and _field_path(e).startswith(param)), None)
    if refused is not None:
        where = _field_path(refused)  # prompt.2 when the third prompt of a list is the one
        return APIError(400, f"{where}: {refused['msg'].removeprefix('Value error, ')}", param=where,
                        code="invalid_value")
    # a union field (prompt, stop, content) fails once per accepted type: say what each wanted
    wanted = list(dict.fromkeys(e["msg"] for e in errors if _field_path(e).startswith(param)
                                and len(e["loc"]) - len(first["loc"]) <= 1))
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    wants = " or ".join(wanted).replace(" or Input should be ", " or ")
    code = "invalid_value" if first["type"] == "literal_error" else "invalid_type"
    return APIError(400, f"{param}: {wants}, got {got}", param=param, code=code)

