"""AsyncLLM: the engine streaming outputs to asyncio callers (the server).

`AsyncLLM.spawn(spec)` runs the engine in a process of its own (`brrr serve`): this process validates and
tokenizes, the engine process schedules and runs the model, and the two talk over pipes (engine_process.py).
`AsyncLLM(engine)` runs the same engine loop on an engine object in a thread of this process (tests that build an
engine). Either way, requests are validated here by the engine's own checks before anything is queued, and each
engine step arrives as one message of `EngineOutput` records, which this process's output processor detokenizes,
checks for stop strings and assembles into `RequestOutput`s, on the thread that reads the pipe.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from brrr.engine.core import EngineCore, check_request
from brrr.engine.engine_process import EngineInfo, EngineSpec
from brrr.engine.engine_process_client import EngineClient
from brrr.engine.output_processor import OutputProcessor
from brrr.engine.outputs import EngineOutput, RequestOutput
from brrr.engine.sequence import Request
from brrr.errors import BrrrError
from brrr.lora.serving import LoRARequest
from brrr.sampling_params import SamplingParams
from brrr.tokenizer import Tokenizer


class EngineLimits:
    """The engine's request checks without the engine (`check_request`, what `EngineCore.make_request` runs) on the
    limits the engine reported (context, vocabulary, KV blocks): a request that passes here is one the engine takes."""

    def __init__(self, info: EngineInfo, tokenizer):
        self.info, self.tokenizer = info, tokenizer

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        i = self.info
        if lora_request is not None and i.max_lora_rank is None:
            raise BrrrError(f"LoRA adapter {lora_request.lora_name!r}: the engine serves no adapters (start it with "
                            "--enable-lora)")
        return check_request(request_id, prompt, params, self.tokenizer, i.vocab_size, i.max_model_len, i.block_size,
                             i.num_blocks, lora_request=lora_request, kv_budget_blocks=i.kv_budget_blocks,
                             kv_whole_prompt=i.kv_whole_prompt)


class _LatestOutput:
    """A request's outputs that its consumer has not taken yet, merged into one: a consumer that falls behind the
    engine gets fewer, larger outputs instead of a growing queue."""

    def __init__(self):
        self.pending: RequestOutput | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self.pending = out if self.pending is None else merge_outputs(self.pending, out)
        self.ready.set()

    async def get(self) -> RequestOutput:
        if self.pending is None:
            await self.ready.wait()
        out, self.pending = self.pending, None
        self.ready.clear()
        return out


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer`, carrying the deltas of both: what a consumer that never took `older` must see. The cumulative fields
    (text, token_ids, logprobs) are newer's already."""
    previous = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = previous.get(c.index)
        if prev is not None and (prev.delta_text or prev.delta_token_ids):
            c.delta_text = prev.delta_text + c.delta_text
            c.delta_token_ids = prev.delta_token_ids + c.delta_token_ids
            if prev.delta_logprobs is not None:
                c.delta_logprobs = prev.delta_logprobs + (c.delta_logprobs or [])
    return newer


class _Stream:
    __slots__ = ("loop", "outputs")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.outputs = loop, _LatestOutput()


class AsyncLLM:
    def __init__(self, engine: EngineCore):
        """The engine loop in a thread of this process, on this engine object (which `engine` keeps pointing to)."""
        self.engine: EngineCore | None = engine
        self._start(EngineClient.in_thread(engine), engine.tokenizer)

    @classmethod
    def spawn(cls, spec: EngineSpec) -> "AsyncLLM":
        """The engine in its own process, built there from `spec`. Returns once it is loaded and warmed up;
        raises BrrrError (with the engine's reason) if it could not start."""
        self = cls.__new__(cls)
        self.engine = None
        client = EngineClient.spawn(spec)
        try:
            tokenizer = Tokenizer.from_dir(spec.model)  # while the engine process loads the model
        except BaseException:
            client.shutdown()
            raise
        self._start(client, tokenizer)
        return self

    def _start(self, client: EngineClient, tokenizer) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.info: EngineInfo = client.wait_ready()
        self.limits = EngineLimits(self.info, tokenizer)
        self._streams: dict[str, _Stream] = {}
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self._stopped = False
        client.start_reading(self._on_records, self._on_failure)

    # ---- what the server reads --------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def failure(self) -> str | None:
        """Why the engine is gone, or None while it runs."""
        return self.client.failure

    @property
    def healthy(self) -> bool:
        return self.client.alive and not self._stopped

    def stats(self) -> dict:
        """`EngineCore.stats()` as of the engine's latest step, plus num_free_blocks, num_unfinished_requests and
        num_unfinished_seqs."""
        return self.client.stats

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and tokenize as the engine does; raises BrrrError naming the problem. Queues nothing."""
        return self.limits.make_request(request_id, prompt, params, lora_request)

    # ---- requests ---------------------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields incremental outputs until the request finishes. Invalid input raises BrrrError (a ValueError)
        before anything is queued. Leaving the iterator early (or being cancelled) aborts the request. If the
        engine dies, the last output carries the error."""
        outputs = self.submit(self.make_request(request_id or f"req-{next(self._ids)}", prompt, params))
        try:
            async for out in outputs:
                yield out
        finally:
            outputs.close()

    def submit(self, request: Request) -> "RequestStream":
        """Queue a request `make_request` made, now, from the calling event loop's thread, and return its outputs.
        A server submits in its handler: the engine sees a burst of requests as they are parsed, not after every
        one of them has also started its response. The caller must close() what this returns."""
        if self._stopped:
            raise BrrrError("the engine is shutting down")
        request_id = request.request_id
        if request_id in self._streams:
            raise BrrrError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self.processor.add_request(request)  # before the engine can answer
        self._streams[request_id] = stream  # before the failure check: _on_failure then sees it, or we see failure
        outputs = RequestStream(self, request_id, stream)
        try:
            # the prompt's text stays here: the engine needs only the ids
            self.client.send(("add", Request(request_id, None, request.prompt_token_ids, request.params,
                                             request.arrival_time, lora_request=request.lora_request)))
        except BaseException:
            outputs.close()
            raise
        return outputs

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Have the engine load a (checked) adapter ahead of its first request."""
        self.client.send(("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> None:
        """The engine forgets the adapter: running requests finish on it, queued ones read it again from its path."""
        if self.client.alive:
            self.client.send(("remove_lora", lora_id))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop the request (or its sample `index`) in the engine and free its KV blocks (on the engine's next
        turn)."""
        if index is None:
            self._streams.pop(request_id, None)
            self.processor.abort(request_id)
        if self.client.alive:
            try:
                self.client.send(("abort", request_id, index))
            except BrrrError:
                pass  # the engine is gone, and its requests with it

    def shutdown(self) -> None:
        self._stopped = True
        self.client.shutdown()

    # ---- the reader thread's callbacks ------------------------------------------------------------------------
    def _on_records(self, records: list[EngineOutput]) -> None:
        """One engine step: assemble its outputs and hand each to its stream's event loop, one call per loop (not
        per request). Samples a stop string ended are dropped in the engine."""
        processed = self.processor.process(records)
        for request_id, index in processed.stopped:
            self.abort(request_id, index)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # else its consumer has left, and the abort is on its way
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _on_failure(self, why: str) -> None:
        for request_id, stream in list(self._streams.items()):
            out = self.processor.fail(request_id, f"{why}; the request was lost")
            if out is not None:
                _call_soon(stream.loop, _deliver, [(stream, out)])


class RequestStream:
    """A queued request's outputs, as they arrive (an async iterator). close() aborts it unless it has finished,
    whether or not anyone iterated: KV blocks never outlive their reader."""

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream):
        self.llm, self.request_id, self.stream, self.finished = llm, request_id, stream, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.stream.outputs.get()
        if out.finished or out.error is not None:
            self.finished = True
            self.llm._streams.pop(self.request_id, None)
        return out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)


def _deliver(items) -> None:
    for stream, out in items:
        stream.outputs.put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop has closed: nobody is waiting there
        pass
