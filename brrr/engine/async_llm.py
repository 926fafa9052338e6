"""AsyncLLM: the engine stepping in its own thread, streaming outputs to asyncio callers (the server)."""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator

from brrr.engine.llm_engine import LLMEngine
from brrr.engine.outputs import RequestOutput
from brrr.engine.sampling_params import SamplingParams
from brrr.errors import BrrrError


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque = deque()  # ("add", request, queue, loop) | ("abort", request_id); the thread applies them
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="brrr-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields incremental outputs until the request finishes. Invalid input raises BrrrError (a ValueError)
        before anything is queued. Leaving the iterator early (or being cancelled) aborts the request."""
        if self._stopped:
            raise BrrrError("the engine is shutting down")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise BrrrError(f"request_id {request_id!r} is already in use")
        request = self.engine.make_request(request_id, prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (queue, asyncio.get_running_loop())
        self._command("add", request)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._command("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._command("abort", request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _command(self, *cmd) -> None:
        self._commands.append(cmd)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if not self._commands and not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
            while self._commands:
                kind, arg = self._commands.popleft()
                if kind == "add":
                    self.engine.enqueue(arg)
                else:
                    self.engine.abort(arg)
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream:
                        queue, loop = stream
                        loop.call_soon_threadsafe(queue.put_nowait, out)
