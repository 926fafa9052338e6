"""Which tokens each step trains and evaluates on.

Training: the train split is cut into windows of seq_len + 1 tokens at stride seq_len (inputs and next-token
targets; a window may span several documents, which <|bos|>/<|eos|> separate). Each epoch visits every window
once, in an order drawn from (seed, epoch), so the whole run's order is a function of one integer, the number of
global micro-batches consumed: that integer is all a resume needs. Rank r of `world` takes the r-th slice of
each global micro-batch, so launching more processes shards the data without repeating it.
"""
from __future__ import annotations

import numpy as np
import torch

from brrr.errors import BrrrError


class TrainWindows:
    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int, rank: int = 0, world: int = 1):
        self.tokens, self.seq_len, self.batch, self.seed = tokens, seq_len, batch, seed
        self.rank, self.world = rank, world
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < batch * world:
            raise BrrrError(f"the train split has {len(tokens)} tokens: fewer than one batch of {batch * world} "
                            f"windows of {seq_len} + 1 tokens; lower --micro-batch or --seq-len, or add data")
        self._epoch, self._order = -1, None
        self._offsets = np.arange(seq_len + 1)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return self._order

    def window_indices(self, position: int) -> np.ndarray:
        """Window ids of this rank's share of global micro-batch `position`."""
        first = position * self.batch * self.world + self.rank * self.batch
        ids = np.arange(first, first + self.batch)
        epochs = ids // self.windows
        out = np.empty(self.batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.order(int(e))[ids[sel] % self.windows]
        return out

    def epoch(self, position: int) -> float:
        return position * self.batch * self.world / self.windows

    def batch_at(self, position: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch, seq_len] int64 on `device`."""
        starts = self.window_indices(position) * self.seq_len
        rows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        if torch.device(device).type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]


def eval_windows(start: int, end: int, seq_len: int, max_windows: int | None) -> tuple[np.ndarray, int]:
    """Start offsets of non-overlapping windows inside [start, end) of a split, and their length (seq_len, or
    shorter when the range is): all of them, or max_windows spread evenly. Each window scores length - 1 tokens."""
    length = min(seq_len + 1, end - start)
    if length < 2:
        return np.zeros(0, dtype=np.int64), 0
    count = (end - start - 1) // (length - 1)
    starts = start + np.arange(count, dtype=np.int64) * (length - 1)
    if max_windows is not None and count > max_windows:
        starts = starts[np.linspace(0, count - 1, max_windows).round().astype(np.int64)]
    return starts, length
