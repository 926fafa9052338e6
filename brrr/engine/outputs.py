"""What the engine produces. The engine core emits `EngineOutput` records (one per sample that progressed in a step);
the output processor (output_processor.py) turns them into `RequestOutput`s, vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineOutput:
    """One request's sample after one engine step: only what is new. Crosses the pipe from the engine process."""

    request_id: str
    index: int = 0  # which of the request's n samples
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None  # one entry per new token, when the request asked for them
    # stop (a stop token) | grammar (structured_outputs complete: "stop" to users, the last token is text) | length |
    # abort; None while the sample runs
    finish_reason: str | None = None
    error: str | None = None  # the request failed: every sample ends with it
    new_prompt_logprobs: list[dict[int, float] | None] | None = None  # sample 0 only, as its prompt is computed
    # on the request's first record only: when the scheduler first admitted it, and how many prompt tokens hit the
    # prefix cache
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0

    def __reduce__(self):  # a flat tuple: cheaper to pickle than the default per-slot state
        return EngineOutput, (self.request_id, self.index, self.new_token_ids, self.new_logprobs, self.finish_reason,
                              self.error, self.new_prompt_logprobs, self.first_scheduled_time, self.num_cached_tokens)


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything so far (a possible stop string's start is held back until it is ruled out)
    # everything so far: the sample's own lists, which keep growing while it runs (copy them to keep a snapshot)
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None  # the entries of delta_token_ids


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
