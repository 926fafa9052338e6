"""Iteration-level scheduling (Orca) with chunked prefill (Sarathi-Serve).

Each step, under a token budget and a sequence cap: running decodes first (one token each), then the next chunk
of every running prefill, then new sequences in arrival order. Decodes and prefill chunks share one batch. When
a decode cannot get a KV slot, the most recently admitted sequence is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed, or, under a swap policy (engine/swap.py), with its computed blocks
copied to host blocks first, to be copied back into new device blocks when it is admitted again.

The scheduler owns every sequence's place: it creates sequences (a request's first one, and its n - 1 forks when the
prompt is done), admits them under max_num_seqs, and reserves blocks, also for a decode step planned before the
previous step's tokens are known (`schedule_next_decode`). The engine only runs what it is handed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from brrr.engine.block_manager import BlockManager
from brrr.engine.sequence import Request, Sequence, Status
from brrr.engine.swap import SwapPolicy


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens it contributes this step)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies (src, dst) to do first
    # swap preemption's copies, done before anything else in the step: (device, host) out, then (host, device) in
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # a step planned ahead: for each item, its row in the previous step, whose sampled token is its input
    previous_rows: list[int] | None = None
    # per item, the int the model reads on each of its rows (the runner's RowInput), set in the plan by a feature's
    # `model_inputs` (LoRA rows: the adapter slot); None: every row -1
    row_values: np.ndarray | None = None
    # the eviction policy's notes on this step's items (`compaction`; SnapKV: (sequence, window, kept) for each
    # chunk that ends a prompt it compacts)
    eviction: list[tuple] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int | None = None, max_loras: int | None = None, on_release=None, eviction=None,
                 swap: SwapPolicy | None = None):
        self.block_manager = block_manager
        self.swap = swap  # None: every preemption recomputes
        # a StreamingEviction (engine/eviction.py), SnapKVEviction (snapkv.py), H2OEviction (h2o.py) or None: every
        # token kept
        self.eviction = eviction
        # called with a sequence that lost its blocks (preempted or finished): a proposer drops its state for it
        self.on_release = on_release
        self.max_loras = max_loras  # distinct adapters the running sequences may use (the device slots)
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = self.num_swapped_out = 0
        self._next_seq_id = 0

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        seq = Sequence(self._next_seq_id, request, index, token_ids, None if seed is None else seed + index)
        self._next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def add_request(self, request: Request) -> Sequence:
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids))
        self.waiting.append(seq)
        return seq

    def add_prefilled(self, request: Request, token_ids: list[int], block_table: list[int]) -> Sequence:
        """A sequence whose prompt another instance computed (disaggregated prefill): the prompt's KV is in
        `block_table` already, so it joins the running batch to decode its last token."""
        seq = self._new_sequence(request, 0, token_ids)
        seq.block_table, seq.num_computed_tokens, seq.status = block_table, len(token_ids) - 1, Status.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(seq)
        return seq

    def make_forks(self, parent: Sequence) -> list[Sequence]:
        """The request's other n - 1 samples, sampled from the parent's last prompt row in the step that completes
        the prompt; `admit_forks` places them once that step has run."""
        request = parent.request
        return [self._new_sequence(request, i, list(parent.token_ids)) for i in range(1, request.params.n)]

    def admit_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Forks take free places under max_num_seqs, sharing the parent's computed blocks; the rest wait at the
        head of the queue without blocks, like preempted sequences (prefix caching finds the shared prompt)."""
        free = max(0, self.max_num_seqs - len(self.running))
        for child in children[:free]:
            self.block_manager.fork(parent, child)
            child.status = Status.RUNNING
            self.running.append(child)
        for child in reversed(children[free:]):
            self.waiting.appendleft(child)

    def at_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether seq has reached max_tokens or the context, counting `pending` tokens not yet appended."""
        return (seq.num_output_tokens + pending >= seq.request.params.max_tokens
                or (self.max_model_len is not None and len(seq.token_ids) + pending >= self.max_model_len))

    def schedule_next_decode(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Step t+1 of the same sequences, planned before step t's tokens reach the host, when nothing else could
        take a place in it: every running sequence decodes in `batch`, and no waiting one could be admitted now (a
        full batch, or too few free blocks for the queue's head, keeps it waiting either way; one admitted after a
        finish joins a step later). Sequences that step t ends for sure (length) are left out; ones a stop token
        ends are computed and their token dropped. Reserves the blocks step t+1 writes to; None when it can't."""
        bm, ev = self.block_manager, self.eviction
        # an evicting policy plans decodes on the host, and a compaction (batch.eviction) moves the rows the next
        # step's slots are counted from when step t commits
        if len(self.running) != len(batch.items) or ev is not None and (ev.plans_decodes or batch.eviction):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs and bm.can_allocate(self.waiting[0]):
            return None
        rows, items = [], []
        for row, (seq, _) in enumerate(batch.items):
            if seq.finished or self.at_length(seq, pending=1):  # step t's token ends it
                continue
            rows.append(row)
            items.append((seq, 1))
        # step t+1 writes position len(token_ids): its block (counted on cache rows, past what eviction dropped)
        # must exist
        grow = [seq for seq, _ in items if len(seq.block_table) + seq.num_evicted_blocks
                < bm.blocks_for(len(seq.token_ids) + 1 - seq.num_dropped_tokens)]
        if not items or len(grow) > bm.num_free_blocks:
            return None
        for seq in grow:
            seq.block_table.append(bm.allocate_block())
        return self._with_host_copies(ScheduledBatch(items, previous_rows=rows))

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed == 1]:  # decodes
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if self.eviction is not None:  # the blocks its query no longer sees go back first
                self.eviction.make_room(seq, len(seq.token_ids) - 1)
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self.preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            copy = self.block_manager.append_slot(seq)
            if copy:
                batch.copies.append(copy)
            batch.items.append((seq, 1))
            budget -= 1
        budget = self._schedule_drafts(batch, budget)
        for seq in self.running:  # prefills already under way
            if seq.num_uncomputed > 1 and budget > 0:
                n = min(seq.num_uncomputed, budget)
                if self.eviction is not None:
                    n = self._evicting_chunk(seq, n, batch)
                    if n == 0:
                        continue
                batch.items.append((seq, n))
                budget -= n
        adapters = self.running_adapters() if self.max_loras is not None else None
        i, slot_blocked = 0, False
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            lora = seq.request.lora_request
            if lora is not None and adapters is not None and (slot_blocked or (
                    lora.lora_int_id not in adapters and len(adapters) >= self.max_loras)):
                # every slot is held by running sequences' adapters: it waits. Base-model requests behind it may
                # go; adapter requests may not, or a stream of them could keep its slot from ever coming free.
                slot_blocked = True
                i += 1
                continue
            admit = None if self.eviction is None else self.eviction.admit_tokens(seq)
            # a swapped-out sequence comes back in a step without copy-on-write copies: they run after the swap
            # copies, and a shared block one of them reads may have been freed (its other holder preempted) and
            # taken for the copy-in
            if not self.block_manager.can_allocate(seq, admit) or (seq.host_table and batch.copies):
                break  # first come, first served: nobody overtakes the head of the queue
            del self.waiting[i]
            if lora is not None and adapters is not None:
                adapters.add(lora.lora_int_id)
            if seq.host_table:
                self._swap_in(seq, batch)
                n = min(seq.num_uncomputed, budget)
                batch.items.append((seq, n))
                budget -= n
                continue
            cached = self.block_manager.allocate(seq, use_prefix_cache=seq.request.params.prompt_logprobs is None,
                                                 extra_key=seq.request.cache_key, num_tokens=admit)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = time.monotonic()
                seq.request.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            if self.eviction is not None:  # (prefix hits can take it past its admitted blocks)
                n = self._evicting_chunk(seq, n, batch)
                if n == 0:
                    continue
            batch.items.append((seq, n))
            budget -= n
        return self._with_host_copies(batch)

    def _with_host_copies(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The prefix cache's host-tier copies this scheduling made (evicted blocks out, hits in) join the step's
        swap copies, which run before it (brrr/engine/host_prefix.py)."""
        spills, loads = self.block_manager.take_host_copies()
        batch.swap_out += spills
        batch.swap_in += loads
        return batch

    def _evicting_chunk(self, seq: Sequence, n: int, batch: ScheduledBatch) -> int:
        """The next prefill chunk of a sequence under eviction (a prompt or a recompute past the budget: one
        logical block a step), its blocks made: evicting first, then a free block if it still needs one. 0 when
        none is free (it waits a step; decodes free blocks as they finish). A chunk that ends a prompt SnapKV
        compacts is noted in the batch."""
        ev = self.eviction
        n = ev.prefill_chunk(seq, n)
        end = seq.num_computed_tokens + n
        if n == 0 or ev.needs_block(seq, end) and self.block_manager.num_free_blocks == 0:
            return 0
        ev.grow(seq, end)
        compaction = ev.compaction(seq, n)
        if compaction is not None:
            batch.eviction.append((seq, *compaction))
        return n

    def _schedule_drafts(self, batch: ScheduledBatch, budget: int) -> int:
        """Speculating decodes verify their draft tokens in the same step: (seq, 1 + drafts) instead of (seq, 1).
        Drafts take only what every decode's own token left over (budget and free blocks) and never preempt: a
        draft cut short costs a little speed, a preemption costs a recompute. Returns the budget left."""
        bm = self.block_manager
        for i, (seq, n) in enumerate(batch.items):
            if not seq.spec_tokens:
                continue
            room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - len(seq.token_ids)
            d = min(len(seq.spec_tokens), budget, room)
            seq.spec_tokens = seq.spec_tokens[:d]
            if d == 0:
                continue
            while len(seq.block_table) < bm.blocks_for(len(seq.token_ids) + d):
                seq.block_table.append(bm.allocate_block())
            batch.items[i] = (seq, n + d)
            budget -= d
        return budget

    def running_adapters(self) -> set[int]:
        """The adapter ids the running sequences use: they hold device slots."""
        return {s.request.lora_request.lora_int_id for s in self.running if s.request.lora_request is not None}

    def preempt(self, seq: Sequence, batch: ScheduledBatch | None = None) -> None:
        """Back to the head of the queue without its device blocks: swapped out into `batch`'s copies when the swap
        policy says so, else to be recomputed."""
        self.running.remove(seq)
        computed = self.block_manager.blocks_for(seq.num_computed_tokens)  # the blocks whose K/V are written
        if batch is not None and self.swap is not None and self.swap.swaps(seq.num_computed_tokens, computed):
            seq.host_table = self.swap.pool.allocate(computed)
            batch.swap_out += zip(seq.block_table[:computed], seq.host_table)
            self.block_manager.free(seq)  # (the copies run before any step can write these blocks again)
            self.num_swapped_out += 1
        else:
            self.block_manager.free(seq)
            if self.on_release is not None:
                self.on_release(seq)
            seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _swap_in(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """New device blocks for every token (can_allocate checked), the swapped-out ones copied back into the
        first; it runs on from its computed tokens. Its host blocks are free again: any later copy into them is
        queued behind this one."""
        bm = self.block_manager
        seq.block_table = [bm.allocate_block() for _ in range(bm.blocks_for(len(seq.token_ids)))]
        batch.swap_in += zip(seq.host_table, seq.block_table)
        self.swap.pool.free(seq.host_table)
        seq.host_table = []
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.host_table:  # finished (aborted) while swapped out
            self.swap.pool.free(seq.host_table)
            seq.host_table = []
        self.block_manager.free(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
