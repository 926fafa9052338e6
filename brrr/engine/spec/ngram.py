"""Prompt lookup (n-gram) proposer: find the most recent earlier occurrence of the context's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) in the sequence's own tokens and propose the k tokens that followed it.
Free to run and often right where the output copies its input (edits, code, retrieval-grounded answers)."""
from __future__ import annotations

import numpy as np

from brrr.engine.spec.proposer import Proposer, SpecInput


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # seq_id -> (buffer, valid length): the context as an int array, grown in place, so a step converts only the
        # tokens committed since the previous one rather than the whole list
        self._contexts: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, inputs: list[SpecInput], k: int) -> list[list[int]]:
        return [lookup(self._context(x.seq_id, x.token_ids), self.min_n, self.max_n, k) for x in inputs]

    def release(self, seq_id: int) -> None:
        self._contexts.pop(seq_id, None)

    def _context(self, seq_id: int, token_ids: list[int]) -> np.ndarray:
        buf, have = self._contexts.get(seq_id, (None, 0))
        n = len(token_ids)
        if buf is None or n < have:  # new, or a sequence restarted under the same id: rebuild
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        elif n > len(buf):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = token_ids[have:n]
        self._contexts[seq_id] = (buf, n)
        return buf[:n]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (between
    min_n and max_n tokens long) that occurs earlier. Candidates are narrowed one suffix token at a time: the work
    is O(len) for the first token's scan, then O(matches) per further token."""
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return []
    # end positions j < length - 1 of earlier occurrences of the last token (the suffix itself ends at length - 1)
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best = ends if min_n <= 1 else None
    for offset in range(1, max_n):  # grow the matched suffix to offset + 1 tokens
        ends = ends[ends >= offset]
        ends = ends[tokens[ends - offset] == tokens[length - 1 - offset]] if len(ends) else ends
        if not len(ends):
            break
        if offset + 1 >= min_n:
            best = ends
    if best is None or not len(best):
        return []
    start = int(best[-1]) + 1  # the most recent occurrence: the freshest continuation
    return tokens[start:start + k].tolist()
