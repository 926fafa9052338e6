"""How engine outputs become HTTP responses: several engine requests merged into one stream, server-sent events
for /v1/completions and /v1/chat/completions, and cancellation when the client goes away (streaming or not)."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import StreamingResponse

from brrr.engine.outputs import RequestOutput
from brrr.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from brrr.server.responses import Formatter, prompt_only, sse, total_usage
from brrr.server.state import Ticket, close_all
from brrr.server.tool_parsers import tool_delta


class ClientDisconnected(Exception):
    pass


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


SHUTDOWN_ERROR = APIError(503, "the server shut down before this response was complete", code="unavailable")


def _only_cancellation(e: BaseException) -> bool:
    if isinstance(e, BaseExceptionGroup):
        return all(_only_cancellation(inner) for inner in e.exceptions)
    return isinstance(e, asyncio.CancelledError)


class EventStream(StreamingResponse):
    """Server-sent events. Whatever ends the response (done, client gone, shutdown) closes the event generator
    and the engine requests (aborting unfinished ones), and gives back unused admission places. A stream that the
    server's shutdown cancels (--shutdown-timeout exceeded) still ends as a stream does: an error event, then
    [DONE]."""

    def __init__(self, events, ticket: Ticket, streams):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket, self.streams = ticket, streams

    async def __call__(self, scope, receive, send):
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await super().__call__(scope, receive, tracked)
        except BaseException as e:
            if not _only_cancellation(e):
                raise
            # Cancelled by the server's shutdown. Ending the body properly (rather than re-raising, which makes the
            # server log a traceback per stream and cut the body short) lets the client see why.
            await self._end_cut_stream(send, started)
        finally:
            await self.body_iterator.aclose()
            close_all(self.streams)  # the events may never have started (a client gone before the first byte)
            self.ticket.release_all()


    async def _end_cut_stream(self, send, started: bool) -> None:
        try:
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body = (sse(SHUTDOWN_ERROR.body()) + sse("[DONE]")).encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except (OSError, RuntimeError, asyncio.CancelledError):
            pass  # the connection is gone already: nobody to tell


# ---- the endpoints' streaming bodies ----------------------------------------------------------------------------
async def completion_events(body: CompletionRequest, fmt: Formatter, echo_texts: list[str | None], streams):
    """One chunk per engine step that gave a choice new tokens (its text may be empty while the detokenizer holds
    back an incomplete character or a possible stop string): clients see tokens arrive as they are made. Each
    output carries its own deltas; all this keeps is which choices have started and which have finished."""
    n, started, finished, latest = body.n, set(), set(), {}
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                if body.scoring_only:
                    out = prompt_only(out)
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    reason = c.finish_reason if c.finish_reason and index not in finished else None
                    # the echo goes with the first tokens: by then the prompt's logprobs are all in
                    first = index not in started and (c.delta_token_ids or reason)
                    echo = echo_texts[i] if first and body.echo else None
                    if not (c.delta_token_ids or c.delta_text or reason or echo is not None):
                        continue
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = fmt.completion_logprobs(c.delta_token_ids, c.delta_logprobs or [])
                        if echo is not None:
                            prompt_lp = fmt.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs)
                            logprobs = join_logprobs(prompt_lp, logprobs, len(echo))
                    started.add(index)
                    if reason:
                        finished.add(index)
                    choices.append({"index": index, "text": (echo or "") + c.delta_text, "logprobs": logprobs,
                                    "finish_reason": reason})
                latest[i] = out
                if choices:
                    yield sse(fmt.completion_chunk(choices, total_usage(list(latest.values()))
                                                   if body.continuous_usage else None))
        if body.include_usage:
            yield sse(fmt.completion_chunk([], total_usage(list(latest.values()))))
    except APIError as e:
        yield sse(e.body())
    yield sse("[DONE]")


def join_logprobs(prompt_lp: dict, output_lp: dict, offset: int) -> dict:
    """Echoed prompt logprobs followed by the completion's, text offsets continuing after the prompt."""
    return {"tokens": prompt_lp["tokens"] + output_lp["tokens"],
            "token_logprobs": prompt_lp["token_logprobs"] + output_lp["token_logprobs"],
            "top_logprobs": prompt_lp["top_logprobs"] + output_lp["top_logprobs"],
            "text_offset": prompt_lp["text_offset"] + [o + offset for o in output_lp["text_offset"]]}


async def chat_events(body: ChatCompletionRequest, fmt: Formatter, top_logprobs: int | None, stream, tools=None):
    """Like completion_events; each choice's first chunk carries the assistant role, sent with the first token
    (not before it), so the first chunk's arrival is the time to first token. tools (a ToolUse that parses): each
    choice's text goes through its tool-call parser, and calls stream as OpenAI's delta.tool_calls."""
    started, finished, final, parsers, called = set(), set(), None, {}, set()
    try:
        async with aclosing(merge([stream])) as outputs:
            async for _, out in outputs:
                choices = []
                for c in out.outputs:
                    first = c.index not in started
                    reason = c.finish_reason if c.finish_reason and c.index not in finished else None
                    new = bool(c.delta_token_ids or c.delta_text)
                    if not (first or new or reason):
                        continue
                    delta = {"role": "assistant"} if first else {}
                    if c.index not in parsers:
                        parsers[c.index] = tools.parser() if tools else None
                    parser = parsers[c.index]
                    if parser is None:
                        if first or new:
                            delta["content"] = c.delta_text
                    else:
                        events = parser.feed(c.delta_text) + (parser.finish() if reason else [])
                        delta.update(tool_delta(events))
                        if "tool_calls" in delta:
                            called.add(c.index)
                        if reason and c.index in called:
                            reason = "tool_calls"
                        if first and len(delta) == 1:
                            delta["content"] = ""
                        if not (delta or reason or top_logprobs is not None):
                            continue  # the parser holds the text back (a call's name is still being written)
                    logprobs = None
                    if top_logprobs is not None:
                        logprobs = fmt.chat_logprobs(c.delta_token_ids, c.delta_logprobs or [], top_logprobs)
                    started.add(c.index)
                    if reason:
                        finished.add(c.index)
                    choices.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
                final = out
                if choices:
                    yield sse(fmt.chat_chunk(choices, total_usage([out]) if body.continuous_usage else None))
        if body.include_usage:
            yield sse(fmt.chat_chunk([], total_usage([final] if final else [])))
    except APIError as e:
        yield sse(e.body())
    yield sse("[DONE]")
