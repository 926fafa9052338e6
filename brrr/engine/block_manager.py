"""A fixed pool of KV-cache blocks: per-sequence block tables, reference counts, copy-on-write for forked
sequences, and prefix caching by chained content hash of full blocks with LRU eviction of cached free blocks.

A block's hash is registered only once its K/V are computed, so a prefix hit never reads a block that is still
being filled. Freed blocks keep their hash (and stay findable) until the pool needs them back; with a host tier
(brrr/engine/host_prefix.py) they are then copied to host memory and stay findable there.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from brrr.engine.host_prefix import HostPrefixTier
from brrr.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, None, None


def chain_hash(parent: int | None, token_ids: tuple[int, ...], extra=None) -> int:
    """Hash of a full block given its parent's hash: equal iff the whole prefix (and extra key) is equal,
    up to collisions, which `allocate` guards against by comparing the block's tokens."""
    return hash((parent, token_ids, extra))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_tier: HostPrefixTier | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # first = least recently freed = evicted first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = self.prefix_hits = 0  # in tokens, as vLLM counts them
        self.host_tier = host_tier if enable_prefix_caching else None
        self._spills: list[tuple[int, int]] = []  # (device, host) copies the next step must make first
        self._loads: list[tuple[int, int]] = []  # (host, device)

    @property
    def host_hits(self) -> int:
        """Tokens of prefix hits served from the host tier."""
        return 0 if self.host_tier is None else self.host_tier.loaded * self.block_size

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                host = None if self.host_tier is None else self.host_tier.store(block.hash, block.token_ids)
                if host is not None:
                    self._spills.append((block_id, host))
            block.hash = block.token_ids = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.free_cached[block_id] = None
            else:
                self.free_uncached.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's hash (vLLM's reset_prefix_cache): after the KV cache was freed, or the
        weights changed, no block holds what its hash says. Only with no sequence running."""
        for block in self.blocks:
            block.hash = block.token_ids = None
        self.hash_to_block.clear()
        self.free_uncached.extend(self.free_cached)
        self.free_cached.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        self._spills, self._loads = [], []

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        return self.blocks_for(len(seq.token_ids) if num_tokens is None else num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True, extra_key=None, num_tokens: int | None = None
                 ) -> int:
        """Blocks for all of seq's tokens (the first num_tokens: an evicting sequence's budget), reusing cached full
        blocks of its prefix. Returns the cached tokens. At least the last token is always left to compute, so the
        step has a row to sample from."""
        assert not seq.block_table, "sequence already has blocks"
        tokens, bs = seq.token_ids, self.block_size
        num_tokens = len(tokens) if num_tokens is None else num_tokens
        parent, table, hashes = None, [], []
        searchable = min((len(tokens) - 1) // bs, num_tokens // bs) \
            if self.enable_prefix_caching and use_prefix_cache else 0
        for i in range(searchable):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk, extra_key)
            block_id = self.hash_to_block.get(h)
            if block_id is not None and self.blocks[block_id].token_ids == chunk:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_cached[block_id]
                block.ref_count += 1
            else:
                block_id = self._load_from_host(h, chunk)
                if block_id is None:
                    break
            table.append(block_id)
            hashes.append(h)
            parent = h
        cached = len(table) * bs
        table += [self._take() for _ in range(self.blocks_for(num_tokens) - len(table))]
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = table, hashes, cached
        if self.enable_prefix_caching and use_prefix_cache:
            self.prefix_queries += len(tokens)
            self.prefix_hits += cached
        return cached

    def _load_from_host(self, block_hash: int, chunk: tuple[int, ...]) -> int | None:
        """A device block for a prefix block the host tier holds (registered at once: its copy in runs before the
        step reads it), or None."""
        host = None if self.host_tier is None or not self.num_free_blocks else self.host_tier.lookup(block_hash, chunk)
        if host is None:
            return None
        block_id = self._take()
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, chunk
        self.hash_to_block[block_hash] = block_id
        self._loads.append((host, block_id))
        return block_id

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies since the last call, (device, host) out and (host, device) in, for the step
        about to run; its entries found meanwhile are unpinned (their copies are queued first)."""
        spills, loads = self._spills, self._loads
        self._spills, self._loads = [], []
        if self.host_tier is not None:
            self.host_tier.unpin_all()
        return spills, loads

    def commit_computed(self, seq: Sequence, extra_key=None) -> None:
        """Register hashes of blocks that became full and computed, so later requests can reuse them. None once the
        sequence has evicted a block: what it computes after that saw a truncated context."""
        if not self.enable_prefix_caching or seq.num_evicted_blocks or seq.num_dropped_tokens:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, chunk, extra_key)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, chunk
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)

    def allocate_block(self) -> int:
        """One fresh block (the caller appends it to a table); the caller checked num_free_blocks."""
        return self._take()

    def _needs_block(self, seq: Sequence) -> bool:
        cached = len(seq.token_ids) - seq.num_dropped_tokens  # cache rows it needs (snapkv.py drops some)
        return len(seq.block_table) + seq.num_evicted_blocks < self.blocks_for(cached)

    def _last_index(self, seq: Sequence) -> int:
        """The table index of the block holding position len - 1 (past any evicted blocks or dropped tokens)."""
        return (len(seq.token_ids) - 1 - seq.num_dropped_tokens) // self.block_size - seq.num_evicted_blocks

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next token (position len-1) can get a slot: a new block, or a private copy of a shared one."""
        if self._needs_block(seq):
            return self.num_free_blocks >= 1
        last = self.blocks[seq.block_table[self._last_index(seq)]]
        return last.ref_count == 1 or self.num_free_blocks >= 1

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make position len-1 writable. Returns (src, dst) when a shared block had to be copied first."""
        if self._needs_block(seq):
            seq.block_table.append(self._take())
            return None
        index = self._last_index(seq)
        src = seq.block_table[index]
        if self.blocks[src].ref_count == 1:
            return None
        dst = self._take()
        self._release(src)
        seq.block_table[index] = dst
        return src, dst

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past the first `num_tokens` positions (rejected draft tokens' slots). Only uncommitted
        positions are cut: hashed blocks are full and computed, so they lie below num_tokens."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)
        child.num_evicted_blocks, child.num_dropped_tokens = parent.num_evicted_blocks, parent.num_dropped_tokens
        child.num_computed_tokens = parent.num_computed_tokens

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks allocated for no sequence yet (a disaggregated transfer that did not land)."""
        for block_id in reversed(block_ids):
            self._release(block_id)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: the tail is evicted before the shared head
            self._release(block_id)
        seq.block_table, seq.block_hashes, seq.num_evicted_blocks, seq.num_dropped_tokens = [], [], 0, 0

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Refcounts equal table references; free pools hold exactly the unreferenced blocks, once each."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        assert refs == [b.ref_count for b in self.blocks], "refcounts differ from block-table references"
        free = list(self.free_uncached) + list(self.free_cached)
        assert len(free) == len(set(free)), "a block is free twice"
        assert set(free) == {b.block_id for b in self.blocks if b.ref_count == 0}, "free pools != unreferenced"
        assert len(free) + sum(1 for r in refs if r) == self.num_blocks
        assert all(self.blocks[b].hash is not None for b in self.free_cached)
        assert all(self.blocks[b].hash is None for b in self.free_uncached)
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
        if self.host_tier is not None:
            self.host_tier.check_invariants()
