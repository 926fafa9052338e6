"""The output processor: engine records in, `RequestOutput`s out. It owns incremental detokenization, stop strings
and assembly. `LLMEngine` runs it in-process; the server runs it in its own process (`AsyncLLM`), next to the
consumers, so the engine process only schedules and runs the model.

A stop string ends a sample here, not in the engine: `process` returns the (request_id, index) pairs it stopped,
and the caller tells the engine to drop them (`EngineCore.abort`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from brrr.engine.outputs import CompletionOutput, EngineOutput, RequestMetrics, RequestOutput
from brrr.engine.sequence import Request
from brrr.tokenizer import IncrementalDecoder


class _Sample:
    __slots__ = ("token_ids", "logprobs", "text", "emitted", "decoder", "finish_reason", "delta_ids", "delta_lp",
                 "plain")

    def __init__(self, decoder, want_logprobs: bool, stream: bool):
        self.token_ids: list[int] = []
        self.logprobs = [] if want_logprobs else None
        self.text, self.emitted, self.decoder, self.finish_reason = "", 0, decoder, None
        self.delta_ids, self.delta_lp = [], None  # new since the last output (streamed requests only)
        # only token ids to keep (no text, logprobs or deltas): `process` takes a short path
        self.plain = decoder is None and not want_logprobs and not stream


class _RequestState:
    __slots__ = ("request", "stream", "samples", "prompt_logprobs", "metrics", "holdback", "num_finished", "error")

    def __init__(self, request: Request, stream: bool):
        params = request.params
        self.request, self.stream, self.samples = request, stream, {}
        self.prompt_logprobs = [] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(request.arrival_time, None, None, None, 0)
        # a delta's text stops short of what could still be the start of a stop string
        self.holdback = max(map(len, params.stop)) - 1 if params.stop else 0
        self.num_finished, self.error = 0, None


@dataclass
class Processed:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[tuple[str, int]] = field(default_factory=list)  # samples a stop string ended: drop them


def _public(reason: str) -> str:
    """A grammar's completion ends a sample as a stop token does ("stop"), its last token part of the text."""
    return "stop" if reason == "grammar" else reason


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, stream: bool = True) -> None:
        """stream: an output whenever the request progresses; else only its final one."""
        self.states[request.request_id] = _RequestState(request, stream)

    def abort(self, request_id: str) -> None:
        """Forget a request (its consumer left, or it was aborted): its later records are ignored."""
        self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process(self, records: list[EngineOutput]) -> Processed:
        result, touched, states = Processed(), {}, self.states
        for rec in records:
            state = states.get(rec.request_id)
            if state is None:  # aborted meanwhile
                continue
            sample = state.samples.get(rec.index)
            if sample is not None and sample.plain and rec.error is None:  # the offline batch's common case
                sample.token_ids += rec.new_token_ids
                if rec.finish_reason is not None:
                    sample.finish_reason = _public(rec.finish_reason)
                    state.num_finished += 1
                    touched[rec.request_id] = state
                continue
            if rec.error is not None:
                state.error = rec.error
            self._apply(state, rec, result.stopped)
            touched[rec.request_id] = state
        now = time.monotonic()
        for request_id, state in touched.items():
            finished = state.error is not None or state.num_finished == state.request.params.n
            if finished:
                states.pop(request_id, None)  # pop: a server's event loop may abort it meanwhile
                state.metrics.finish_time = now
            if finished or state.stream:
                result.outputs.append(self._output(state, finished))
        return result

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """The request ends here with `error` (the engine is gone): what it made so far, finished."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.error = error
        return self._output(state, True)

    def _apply(self, state: _RequestState, rec: EngineOutput, stopped: list) -> None:
        m = state.metrics
        if rec.first_scheduled_time is not None:
            m.first_scheduled_time, m.num_cached_tokens = rec.first_scheduled_time, rec.num_cached_tokens
        if rec.new_prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs += rec.new_prompt_logprobs
        params = state.request.params
        sample = state.samples.get(rec.index)
        if sample is None:
            decoder = None
            if self.tokenizer is not None:
                decoder = IncrementalDecoder(self.tokenizer, params.skip_special_tokens)
            sample = state.samples[rec.index] = _Sample(decoder, params.logprobs is not None, state.stream)
        if sample.finish_reason is not None:  # a stop string ended it; the engine had a step in flight
            return
        new = rec.new_token_ids
        if new:
            if m.first_token_time is None:
                m.first_token_time = time.monotonic()
            sample.token_ids += new
            if sample.logprobs is not None and rec.new_logprobs:
                sample.logprobs += rec.new_logprobs
            if state.stream:  # the records' own lists: nobody else holds them
                if sample.delta_ids:
                    sample.delta_ids += new
                else:
                    sample.delta_ids = new
                if rec.new_logprobs is not None:
                    if sample.delta_lp:
                        sample.delta_lp += rec.new_logprobs
                    else:
                        sample.delta_lp = rec.new_logprobs
        reason = rec.finish_reason if rec.error is None else "abort"
        if sample.decoder is not None and new:
            reason, keep = self._detokenize(sample, new, reason, params)
            if keep < len(new):  # a speculative run went past the stop string: its tokens end where the text does
                cut = len(new) - keep
                del sample.token_ids[-cut:]
                if state.stream:
                    del sample.delta_ids[-cut:]  # `new` itself, or a list that ends with it
                if sample.logprobs is not None and rec.new_logprobs:
                    del sample.logprobs[-cut:]
                    if state.stream:
                        del sample.delta_lp[-cut:]
            if reason == "stop_string":
                reason = "stop"
                stopped.append((rec.request_id, rec.index))
        if reason is not None:
            sample.finish_reason = _public(reason)
            state.num_finished += 1

    @staticmethod
    def _detokenize(sample: _Sample, new: list[int], reason: str | None, params) -> tuple[str | None, int]:
        """Append the new tokens' text and look for stop strings. Returns the finish reason, "stop_string" when a
        stop string ended the sample here, and how many of the new tokens it keeps: a speculative run brings
        several, and is read one token at a time, as the same tokens one per step would be."""
        # a stop token's text is not part of the output
        for i, token in enumerate(new[:-1] if reason == "stop" else new):
            before = len(sample.text)
            sample.text += sample.decoder.push(token)
            for stop in params.stop:
                at = sample.text.find(stop, max(0, before - len(stop) + 1))
                if at != -1:
                    sample.text = sample.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    return "stop_string", i + 1
        if reason in ("stop", "length", "grammar"):
            sample.text += sample.decoder.flush()  # an incomplete UTF-8 tail held back for a token that won't come
        return reason, len(new)

    def _output(self, state: _RequestState, finished: bool) -> RequestOutput:
        request = state.request
        completions = []
        for index in sorted(state.samples) if len(state.samples) > 1 else state.samples:
            s = state.samples[index]
            done = s.finish_reason is not None or finished
            end = len(s.text) if done else max(s.emitted, len(s.text) - state.holdback)
            delta_text = s.text[s.emitted:end]
            s.emitted = end
            reason = s.finish_reason or ("abort" if finished else None)
            # a request streamed only at its end has no earlier output: its delta is everything
            delta_ids, delta_lp = (s.delta_ids, s.delta_lp) if state.stream else (s.token_ids, s.logprobs)
            completions.append(CompletionOutput(index, s.text[:end] if end < len(s.text) else s.text, s.token_ids,
                                                reason, s.logprobs, delta_text, delta_ids, delta_lp))
            s.delta_ids, s.delta_lp = [], None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             state.prompt_logprobs, state.metrics, state.error)
