"""StreamingLLM eviction inside the paged cache (Xiao et al., 2023): each sequence keeps its first `sink` blocks (the
attention sinks) and its most recent `window` blocks, `budget` blocks in all; blocks in between go back to the block
manager as the sequence grows, so its memory is bounded whatever its length.

Positions: keys are cached after RoPE at their original positions, and queries are rotated at theirs, so this is
window attention with sinks at original positions (not StreamingLLM's cache-relative positions, which would need
the keys cached before RoPE); the positions still lie within the model's RoPE table (max_model_len).

The policy, at block granularity, is a function of the query's position alone: a query at position p (in logical
block j = p // block_size) attends to logical blocks [0, sink) and [max(sink, j - window + 1), j]. A sequence's
block table holds exactly those: the sink blocks, then the window, with `num_evicted_blocks` logical blocks gone
between them; its context length is the kept tokens. So every chunk of a prefill must lie in one logical block once
past the budget (its queries then share one key set), which `prefill_chunk` enforces: a prompt up to `budget` tokens
prefills as usual (its queries see everything), and a preempted sequence longer than that is recomputed one block
at a time, so recompute gives the K/V it had.

A block filled after the sequence's first eviction holds K/V computed over a truncated context, so it is never
hashed for the prefix cache (`BlockManager.commit_computed` stops at the first eviction).
"""
from __future__ import annotations

from brrr.engine.block_manager import BlockManager
from brrr.engine.h2o import H2OEviction
from brrr.engine.sequence import Sequence
from brrr.engine.snapkv import SnapKVEviction


class StreamingEviction:
    # the runner's side of a policy (`observe_items` / `observer`): none, every block goes whole on the host
    observes = False
    allows_graphs = True
    # whether decode steps evict (make_room, after_step): then no step is planned before the last one's tokens
    plans_decodes = True

    def __init__(self, block_manager: BlockManager, budget_tokens: int, sink_tokens: int):
        bs = block_manager.block_size
        self.block_manager = block_manager
        self.budget = budget_tokens // bs  # blocks a sequence holds at most
        self.sink = -(-sink_tokens // bs)
        self.window = self.budget - self.sink
        self.whole_prompt = False  # a prompt past the budget is prefilled one block a step, evicting
        assert self.window >= 2, "EngineConfig checks: the sinks plus two blocks of window"

    @property
    def budget_tokens(self) -> int:
        return self.budget * self.block_manager.block_size

    def make_room(self, seq: Sequence, position: int) -> None:
        """Before position `position` is written: evict the oldest window blocks that its query no longer sees
        (logical blocks below j - window + 1), freeing them back to the pool."""
        bm = self.block_manager
        first_kept = position // bm.block_size - self.window + 1
        while self.sink + seq.num_evicted_blocks < first_kept and len(seq.block_table) > self.sink:
            block_id = seq.block_table.pop(self.sink)
            bm.release_blocks([block_id])
            seq.num_evicted_blocks += 1

    def grow(self, seq: Sequence, end: int) -> None:
        """Blocks for positions up to end - 1 (a chunk inside one logical block past the budget): evict, then take
        what the table lacks. The caller checked there is a free block (`needs_block`)."""
        self.make_room(seq, end - 1)
        bm = self.block_manager
        while len(seq.block_table) + seq.num_evicted_blocks < bm.blocks_for(end):
            seq.block_table.append(bm.allocate_block())

    def needs_block(self, seq: Sequence, end: int) -> bool:
        """Whether computing positions up to end - 1 takes a block from the pool after evicting (a full window
        gives one back for each it takes, so only when the window is not full yet, or nothing was evicted)."""
        bm = self.block_manager
        logical = len(seq.block_table) + seq.num_evicted_blocks
        if logical >= bm.blocks_for(end):
            return False
        evictable = max(0, (end - 1) // bm.block_size - self.window + 1 - self.sink - seq.num_evicted_blocks)
        return bm.blocks_for(end) - logical > min(evictable, len(seq.block_table) - self.sink)

    def compaction(self, seq: Sequence, n: int) -> None:
        """Nothing is compacted in place (SnapKV's is, snapkv.py): blocks go whole as the window moves."""
        return None

    def after_step(self, batch) -> None:
        """Nothing: the blocks went before the step (`make_room`, `grow`)."""

    def release(self, seq: Sequence) -> None:
        """Nothing kept per sequence beyond its blocks."""

    def admit_tokens(self, seq: Sequence) -> int:
        """Tokens whose blocks a sequence is admitted with: the whole prompt up to the budget."""
        return min(len(seq.token_ids), self.budget_tokens)

    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """The largest chunk of at most n tokens from num_computed_tokens the policy allows in one step: up to the
        budget, anything; past it, the rest of the current logical block."""
        start, bs = seq.num_computed_tokens, self.block_manager.block_size
        if start < self.budget_tokens:
            return min(n, self.budget_tokens - start)
        return min(n, (start // bs + 1) * bs - start)


def eviction_policy(ec, block_manager: BlockManager, num_layers: int, device):
    """EngineConfig.kv_eviction's policy object (None: every token kept). The scheduler asks it for chunks and
    blocks; where it `observes`, the runner hands each step's `observe_items` to its `observer`, which runs
    after each layer's attention (AttnMeta.observe)."""
    if ec.kv_eviction is None:
        return None
    if ec.kv_eviction == "streaming":
        return StreamingEviction(block_manager, ec.kv_budget, ec.kv_sink_tokens)
    if ec.kv_eviction == "snapkv":
        return SnapKVEviction(block_manager, ec.kv_budget)
    return H2OEviction(block_manager, ec.kv_budget, num_layers, device)
