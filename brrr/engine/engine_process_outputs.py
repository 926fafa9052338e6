"""What crosses the pipe from the engine to the server after each engine step: one delta per request that progressed
(new text, new token ids, new logprobs, the finish reason and the request's timings), never the output so far, so
the message grows with the step and not with how long the requests have run.

The engine side encodes `LLMEngine.step`'s outputs (`DeltaEncoder`); the server side rebuilds from the deltas the
same cumulative `RequestOutput`s the engine gives in-process (`RequestAssembly`). `merge_outputs` folds two outputs
of a request into one, for a consumer that fell behind.
"""
from __future__ import annotations

from brrr.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brrr.engine.sampling_params import SamplingParams

# A request's delta: (request_id, finished, error, metrics, new prompt logprobs or None, completions), where metrics
# is RequestMetrics' fields in order and each completion is (index, delta_text, delta_token_ids, finish_reason,
# new logprobs or None). Plain tuples: the cheapest thing to pickle.
Delta = tuple


class DeltaEncoder:
    """Engine side. Remembers only how many prompt logprobs it has sent per request that asked for them (the engine
    hands back the whole list each step); everything else is a delta in the engine's own outputs already."""

    def __init__(self):
        self._prompt_logprobs_sent: dict[str, int] = {}

    def encode(self, outputs: list) -> list[Delta]:
        """RequestOutputs to deltas; an engine in `delta_outputs` mode hands out Delta tuples already."""
        return [out if isinstance(out, tuple) else self._delta(out) for out in outputs]

    def forget(self, request_id: str) -> None:
        self._prompt_logprobs_sent.pop(request_id, None)

    def _delta(self, out: RequestOutput) -> Delta:
        new_prompt_logprobs = None
        if out.prompt_logprobs is not None:
            sent = self._prompt_logprobs_sent.get(out.request_id, 0)
            new_prompt_logprobs = out.prompt_logprobs[sent:]
            if out.finished or out.error is not None:
                self.forget(out.request_id)
            else:
                self._prompt_logprobs_sent[out.request_id] = len(out.prompt_logprobs)
        completions = []
        for c in out.outputs:
            # one logprob entry per output token, so the new tokens' entries are the last ones
            new_logprobs = None if c.logprobs is None else c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]
            completions.append((c.index, c.delta_text, c.delta_token_ids, c.finish_reason, new_logprobs))
        m = out.metrics
        metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time, m.num_cached_tokens)
        return out.request_id, out.finished, out.error, metrics, new_prompt_logprobs, completions


def failure_delta(request_id: str, error: str, arrival_time: float) -> Delta:
    """A request the engine could not take (or lost): finished, with the error, and no tokens."""
    return request_id, True, error, (arrival_time, None, None, None, 0), None, []


class _Completion:
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason")

    def __init__(self, want_logprobs: bool):
        self.text, self.token_ids, self.finish_reason = "", [], None
        self.logprobs = [] if want_logprobs else None


class RequestAssembly:
    """Server side: one request's output so far, grown by its deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.want_logprobs = params.logprobs is not None
        self.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        self.completions: dict[int, _Completion] = {}
        self.metrics = RequestMetrics(arrival_time, None, None, None, 0)

    def apply(self, delta: Delta) -> RequestOutput:
        _, finished, error, metrics, new_prompt_logprobs, completions = delta
        self.metrics = RequestMetrics(*metrics)
        if new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(new_prompt_logprobs)
        outputs = []
        for index, delta_text, delta_token_ids, finish_reason, new_logprobs in completions:
            c = self.completions.get(index)
            if c is None:
                c = self.completions[index] = _Completion(self.want_logprobs)
            c.text += delta_text
            c.token_ids.extend(delta_token_ids)
            if new_logprobs and c.logprobs is not None:
                c.logprobs.extend(new_logprobs)
            c.finish_reason = finish_reason
            # copies: an output handed out earlier must not change under its reader
            outputs.append(CompletionOutput(index, c.text, list(c.token_ids), finish_reason,
                                            None if c.logprobs is None else list(c.logprobs), delta_text,
                                            delta_token_ids))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             self.prompt_logprobs, self.metrics, error)

    def fail(self, error: str) -> RequestOutput:
        """The request ends here with `error` (the engine is gone): what it made so far, finished."""
        outputs = [CompletionOutput(i, c.text, list(c.token_ids), c.finish_reason or "abort",
                                    None if c.logprobs is None else list(c.logprobs))
                   for i, c in sorted(self.completions.items())]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, True,
                             self.prompt_logprobs, self.metrics, error)


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer`, carrying the deltas of both: what a consumer that never took `older` must see. The cumulative fields
    (text, token_ids, logprobs) are newer's already."""
    previous = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = previous.get(c.index)
        if prev is not None and (prev.delta_text or prev.delta_token_ids):
            c.delta_text = prev.delta_text + c.delta_text
            c.delta_token_ids = prev.delta_token_ids + c.delta_token_ids
    return newer
