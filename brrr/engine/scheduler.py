"""Iteration-level scheduling (Orca) with chunked prefill (Sarathi-Serve).

Each step, under a token budget and a sequence cap: running decodes first (one token each), then the next chunk
of every running prefill, then new sequences in arrival order. Decodes and prefill chunks share one batch. When
a decode cannot get a KV slot, the most recently admitted sequence is preempted by recompute: its blocks are
freed and it goes back to the front of the queue.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from brrr.engine.block_manager import BlockManager
from brrr.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens it contributes this step)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies (src, dst) to do first

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed == 1]:  # decodes
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            copy = self.block_manager.append_slot(seq)
            if copy:
                batch.copies.append(copy)
            batch.items.append((seq, 1))
            budget -= 1
        for seq in self.running:  # prefills already under way
            if seq.num_uncomputed > 1 and budget > 0:
                n = min(seq.num_uncomputed, budget)
                batch.items.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            cached = self.block_manager.allocate(seq, use_prefix_cache=seq.request.params.prompt_logprobs is None)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = time.monotonic()
                seq.request.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
