"""Structured outputs as a plug-in feature of the engine step (core/feature.py): each guided sequence's matcher
masks the logits of its rows, advances on every appended token, and ends the sequence when the grammar is complete.

A step planned ahead of the one in flight cannot have its masks yet (they follow the previous token, which the
host has not read): its forward is queued at once and its sampling waits for the masks, which the mask thread
fills once that token has advanced the matchers (`after_step`), while the device runs the forward."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from brrr.engine.core.feature import Feature
from brrr.engine.guided.backend import compiler_for
from brrr.engine.guided.bitmask import fill_bitmask
from brrr.engine.sequence import Request
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")
_MASK_THREAD: ThreadPoolExecutor | None = None


def _mask_thread() -> ThreadPoolExecutor:
    global _MASK_THREAD
    if _MASK_THREAD is None:
        _MASK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="brrr-masks")
    return _MASK_THREAD


def grammars(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None):
    """The grammar compiler over this tokenizer and vocabulary (brrr/engine/guided/)."""
    if tokenizer is None:
        raise BrrrError("structured_outputs: this engine has no tokenizer, and a grammar is compiled against the "
                        "vocabulary")
    if eos_token_ids is None:
        eos_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return compiler_for(tokenizer, vocab_size, eos_token_ids)


class Guided(Feature):
    name = "guided"
    per_request = True

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids

    def wants(self, request: Request) -> bool:
        return request.params.structured_outputs is not None

    def sample_row(self, seq, offset, row):
        spec = seq.request.params.structured_outputs
        if spec is None:
            return row
        if seq.guide is None:  # its first token: each sample its own matcher
            seq.guide = grammars(self.tokenizer, self.vocab_size, self.eos_token_ids).matcher(spec)
        # a verified position: the grammar past the drafts before it
        row.guide = seq.guide.advanced(seq.spec_tokens[:offset]) if offset and seq.spec_tokens else seq.guide
        return row

    def adopt(self, seq, tokens) -> None:
        spec = seq.request.params.structured_outputs
        if spec is not None:
            seq.guide = grammars(self.tokenizer, self.vocab_size, self.eos_token_ids).matcher(spec)
            for token in tokens:
                seq.guide.accept(token)

    def defers_sampling(self, plan) -> bool:
        return any(row.guide is not None for row in plan.rows)

    def finish_reason(self, seq, token: int) -> str | None:
        if seq.guide is None:
            return None
        if not seq.guide.accept(token):  # the mask allowed it: a backend fault
            log.error("request %s: the grammar rejected token %d it allowed: %s", seq.request.request_id, token,
                      seq.guide.error)
            return "abort"
        return "grammar" if seq.guide.finished else None  # complete, and nothing may follow

    def after_step(self, queued) -> None:
        """The step queued ahead waits for its masks: fill them on the mask thread (llguidance works outside the
        GIL), overlapping the host's work until the next step samples it. A sequence that has just finished
        samples unconstrained (its grammar may be complete or dead; the token is dropped either way)."""
        if queued is None or queued.logits is None:
            return
        plan = queued.plan
        for (_, seq, _), row in zip(plan.each_slot(), plan.rows):
            if seq.finished:
                row.guide = None
        guides = [row.guide for row in plan.rows if row.guide is not None]
        if guides:
            queued.mask = _mask_thread().submit(fill_bitmask, guides, queued.logits.shape[1], queued.logits.is_cuda)
