"""What the engine hands back: one RequestOutput per request per step it made progress in."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything so far (a possible stop string's start is held back until it is ruled out)
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None
    metrics: RequestMetrics
    error: str | None = None
