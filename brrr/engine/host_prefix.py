"""The prefix cache's host tier (`--kv-offloading-size`): full, computed blocks that the device pool evicts are
copied to pinned host blocks instead of being forgotten, and a later prompt whose prefix hashes to one of them gets
a device block filled from the host copy, not recomputed.

The block manager asks the tier at its two decisions: when it reuses a cached free block (`store`: a host block
for its contents, the least recently used entry making room when the tier is full), and when a prefix lookup
misses on the device (`lookup`). The copies it collects are the step's swap copies (`ModelRunner.swap_blocks`
runs every copy out, then every copy in, before the step's forward): an evicted block is read before anything
overwrites it, and a loaded block is written before attention reads it. An entry found this step is pinned until
its copy is queued (`unpin_all`), so a spill in the same step cannot reuse its host block first.
"""
from __future__ import annotations

from collections import OrderedDict


class HostPrefixTier:
    """Host block ids [first, first + num_blocks) of the runner's host caches, and which prefix block each holds:
    hash -> (host block, the block's token ids), least recently used first."""

    def __init__(self, first: int, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(first + num_blocks - 1, first - 1, -1))  # popped from the end: lowest first
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._pinned: set[int] = set()
        self.stored = self.loaded = 0  # blocks copied out / back in, over the engine's life

    def store(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The host block to copy an evicted device block into, or None: already held (the same prefix, so the
        same K/V), or every entry pinned."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if not self._free:
            victim = next((h for h in self.entries if h not in self._pinned), None)
            if victim is None:
                return None
            self._free.append(self.entries.pop(victim)[0])
        host = self._free.pop()
        self.entries[block_hash] = (host, token_ids)
        self.stored += 1
        return host

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The host block holding this prefix block (pinned until `unpin_all`), or None."""
        entry = self.entries.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return None
        self.entries.move_to_end(block_hash)
        self._pinned.add(block_hash)
        self.loaded += 1
        return entry[0]

    def unpin_all(self) -> None:
        self._pinned.clear()

    def clear(self) -> None:
        """Forget every entry (the weights or the cache changed: no copy holds what its hash says)."""
        self._free += [host for host, _ in self.entries.values()]
        self._free.sort(reverse=True)
        self.entries.clear()
        self._pinned.clear()

    def check_invariants(self) -> None:
        held = [host for host, _ in self.entries.values()]
        assert len(held) + len(self._free) == self.num_blocks == len(set(held) | set(self._free)), \
            "a host prefix block is lost or held twice"
