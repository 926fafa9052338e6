"""SamplingParams: everything a request says about how to pick its tokens, validated field by field."""
from __future__ import annotations

import json as jsonlib
import math
from dataclasses import dataclass, field, fields

from brrr.errors import BrrrError

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values; larger ones are clamped to it


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one field set. The grammar is compiled, and so fully
    checked, when the engine makes the request (brrr/engine/guided/)."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it (Rust regex syntax: no look-around, no backreferences)
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), or GBNF/EBNF (`root ::= ...`)

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise BrrrError(f"structured_outputs: exactly one of {names} must be set, got "
                            f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise BrrrError(f"structured_outputs.json: not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise BrrrError(f"structured_outputs.json: a JSON schema must be an object, got "
                                f"{type(schema).__name__}")
        if not isinstance(self.json_object, bool):
            raise BrrrError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise BrrrError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise BrrrError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                            f"{self.choice!r}")

    @property
    def kind(self) -> str:
        """The field that is set: the path every error about this constraint starts with."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None  # per request: the same tokens whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1  # parallel samples sharing the prompt's KV blocks
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = only the sampled token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this (guided decoding)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check("max_tokens", self.max_tokens, int, self.max_tokens >= 1 if _is(self.max_tokens, int) else False, ">= 1")
        _check("min_tokens", self.min_tokens, int, _is(self.min_tokens, int) and 0 <= self.min_tokens, ">= 0")
        if _is(self.min_tokens, int) and _is(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            raise BrrrError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _range("temperature", self.temperature, 0, 100, "in [0, 100]")
        _check("top_k", self.top_k, int, _is(self.top_k, int) and self.top_k >= 0, ">= 0 (0 or -1 disables it)")
        _range("top_p", self.top_p, 0, 1, "in (0, 1]", low_open=True)
        _range("min_p", self.min_p, 0, 1, "in [0, 1]")
        _range("repetition_penalty", self.repetition_penalty, 0, 100, "in (0, 100]", low_open=True)
        _range("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        _range("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        if self.seed is not None:
            _check("seed", self.seed, int, _is(self.seed, int) and 0 <= self.seed < 2**63, "in [0, 2**63)")
        _check("n", self.n, int, _is(self.n, int) and 1 <= self.n <= 128, "in [1, 128]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(name, value, int, _is(value, int) and 0 <= value <= 20, "in [0, 20]")
        if not (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop)):
            raise BrrrError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not (isinstance(self.stop_token_ids, list) and all(_is(t, int) and t >= 0 for t in self.stop_token_ids)):
            raise BrrrError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise BrrrError(f"structured_outputs must be a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias) -> dict[int, float]:
    """Ids as ints (a JSON body's keys are strings), values clamped to OpenAI's range; ids outside the vocabulary
    are the engine's check (check_request), which knows the vocabulary."""
    if not isinstance(bias, dict):
        raise BrrrError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not _is(token, int):
            raise BrrrError(f"logit_bias: token id {key!r} is not an integer")
        if not _is(value, (int, float)) or not math.isfinite(value):
            raise BrrrError(f"logit_bias[{token}] must be a finite number, got {value!r}")
        out[token] = float(min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT))
    return out


def _is(value, typ) -> bool:
    return isinstance(value, typ) and not isinstance(value, bool)


def _check(name, value, typ, ok, limit):
    if not _is(value, typ):
        raise BrrrError(f"{name} must be an integer, got {value!r}")
    if not ok:
        raise BrrrError(f"{name} must be {limit}, got {value!r}")


def _range(name, value, low, high, limit, low_open=False):
    if not _is(value, (int, float)):
        raise BrrrError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):  # NaN compares False
        raise BrrrError(f"{name} must be {limit}, got {value!r}")
