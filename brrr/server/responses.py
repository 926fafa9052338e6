"""OpenAI response bodies and stream chunks built from engine RequestOutputs (plain dicts: cheap to serialize)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from brrr.engine.outputs import CompletionOutput, RequestOutput

MIN_LOGPROB = -9999.0  # JSON has no -inf; a masked token reports this instead


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def sse(payload: dict | str) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Formatter:
    """Knows the response id, model name and creation time, and how to spell a token: token_text(id) shows it
    (special tokens included), token_width(id) is how many characters it adds to the returned text."""

    def __init__(self, response_id: str, model: str, created: int, token_text, token_width):
        self.id, self.model, self.created = response_id, model, created
        self.token_text, self.token_width = token_text, token_width

    # ---- logprobs ---------------------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], entries: list[dict | None], text_offset: int = 0) -> dict:
        """Legacy completions shape: parallel lists; top_logprobs holds the chosen token plus the top-k."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += self.token_width(token_id)
            if entry is None:  # the first prompt token: nothing predicts it
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(_finite(entry[token_id]))
                ranked: dict[str, float] = {}
                for t, lp in _ranked(entry):  # tokens that read alike share a key: it keeps the likeliest
                    ranked.setdefault(self.token_text(t), _finite(lp))
                top.append(ranked)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], entries: list[dict], top_k: int) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries):
            content.append({**self._chat_token(token_id, entry[token_id]),
                            "top_logprobs": [self._chat_token(t, lp) for t, lp in _ranked(entry)[:top_k]]})
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    # ---- /v1/completions --------------------------------------------------------------------------------------
    def completion_choice(self, index: int, c: CompletionOutput, echo_text: str | None, logprobs: dict | None) -> dict:
        text = c.text if echo_text is None else echo_text + c.text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def completion(self, choices: list[dict], usage_: dict) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}

    def completion_chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk

    # ---- /v1/chat/completions ---------------------------------------------------------------------------------
    def chat(self, choices: list[dict], usage_: dict) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}

    @staticmethod
    def chat_choice(index: int, c: CompletionOutput, logprobs: dict | None, parser=None) -> dict:
        """parser: a ToolCallParser when the reply may hold tool calls."""
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if parser is not None:
            parser.feed(c.text)
            parser.finish()
            content, calls = parser.result()
            if calls:
                message["content"], reason = content, "tool_calls"
                message["tool_calls"] = [{"id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def chat_chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if usage_ is not None:
            chunk["usage"] = usage_
        return chunk


def best_samples(samples: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples with the highest cumulative logprob of their tokens, best first, indexed 0..n-1."""
    def score(c: CompletionOutput) -> float:
        return sum(entry[t] for t, entry in zip(c.token_ids, c.logprobs or []))

    return [replace(c, index=i) for i, c in enumerate(sorted(samples, key=score, reverse=True)[:n])]


def prompt_only(out: RequestOutput) -> RequestOutput:
    """A scoring-only request's output (max_tokens 0 with echo): the one token the engine drew to get there taken
    out, so the reply is the prompt, its logprobs and no completion."""
    def bare(c: CompletionOutput) -> CompletionOutput:
        empty = None if c.logprobs is None else []
        return replace(c, text="", token_ids=[], logprobs=empty, delta_text="", delta_token_ids=[],
                       delta_logprobs=empty, finish_reason="length" if c.finish_reason else None)

    return replace(out, outputs=[bare(c) for c in out.outputs])


def total_usage(finals: list[RequestOutput]) -> dict:
    """Usage over every prompt of a request: each prompt counted once, every sample's tokens counted."""
    return usage(sum(len(o.prompt_token_ids) for o in finals),
                 sum(len(c.token_ids) for o in finals for c in o.outputs),
                 sum(o.metrics.num_cached_tokens for o in finals))
