"""H2O eviction inside the paged cache (Zhang et al., 2023): each layer's KV heads keep the heavy hitters, the rows
with the most attention mass accumulated over every query so far, and the most recent tokens, `budget - 1` rows in
all between steps (a step's new token makes `budget`).

For KV head h and its cached row t, over every query i that has seen t and the query heads g of h's group (GQA):

    acc[h, t] = sum_i sum_g softmax_t(q[i, g] . k[t, h] * scale)

A prompt longer than budget - 1 is prefilled whole, its queries adding to acc chunk by chunk, and the step that ends
it keeps, per head, the last R = budget // 2 positions and the top budget - 1 - R others by acc (ties: the lower
position), moved into the sequence's first budget - 1 rows in original order. Past that, each step's new token is
written to row budget - 1, adds its attention to acc, and each head then evicts the row of least acc among those
not within the R most recent positions: the new row moves into it. Attention sums over keys in any order, and keys
were cached after RoPE, so rows keep their original positions whatever row they sit in; every head keeps as many
rows, so one block table serves all, and `Sequence.num_dropped_tokens` maps the next position to row budget - 1.

acc and each row's position live beside the cache, per sequence (`H2OState`), and are updated in plain torch right
after each layer's attention (`H2OObserver`, the step's AttnMeta.observe): decode steps run eagerly (no CUDA
graphs under h2o). A preempted sequence recomputes its prompt, then its generated tokens one a step, evicting as it
did, so it gets back the rows it had.
"""
from __future__ import annotations

import torch

from brrr.engine.block_manager import BlockManager
from brrr.engine.sequence import Sequence
from brrr.engine.snapkv import CompactedBlocks, move_rows, read_keys, sequence_rows
from brrr.kernels.attention.kv_quant import as_bytes

QUERY_CHUNK = 512  # queries scored at once: a long prompt chunk's scores would be [chunk, context] per head


class H2OState:
    """Per sequence (by seq_id), on the cache's device: acc [layers, KVH, rows] float32 and pos [layers, KVH, rows]
    (the position each row holds, per head). capacity: the rows kept between steps; recent: positions always kept."""

    def __init__(self, budget_tokens: int, num_layers: int, device):
        self.capacity, self.recent = budget_tokens - 1, budget_tokens // 2
        self.num_layers, self.device = num_layers, device
        self.sequences: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, seq_id: int, n_kv: int, rows: int) -> None:
        """A sequence's prefill starts (again, after a preemption): nothing accumulated yet."""
        shape = (self.num_layers, n_kv, rows)
        self.sequences[seq_id] = (torch.zeros(shape, dtype=torch.float32, device=self.device),
                                  torch.zeros(shape, dtype=torch.long, device=self.device))

    def release(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)


def attention_mass(q: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n, H, D] at positions q_pos [n]; keys [T, KVH, D] holding positions key_pos [KVH, T] -> [KVH, T]: the
    attention each row gets from the queries that see it (key position <= query position), summed over the
    queries and each KV head's query heads."""
    n, n_heads, dim = q.shape
    n_kv = keys.shape[1]
    mass = torch.zeros(key_pos.shape, dtype=torch.float32, device=keys.device)
    for lo in range(0, n, QUERY_CHUNK):
        qc = q[lo:lo + QUERY_CHUNK].float().view(-1, n_kv, n_heads // n_kv, dim)
        logits = torch.einsum("nkgd,tkd->kgnt", qc, keys) * scale
        hidden = key_pos[:, None, None, :] > q_pos[lo:lo + QUERY_CHUNK][None, None, :, None]
        mass += logits.masked_fill(hidden, float("-inf")).softmax(-1).sum((1, 2))
    return mass


class H2OObserver:
    """AttnMeta.observe for a step under h2o. items: (batch row, first query's row in the flattened step, new
    tokens, first new position, rows cached before the step, seq_id, prompt length) for each sequence."""

    def __init__(self, items: list[tuple[int, int, int, int, int, int, int]], tables: torch.Tensor,
                 kv_caches: list, state: H2OState):
        self.items, self.tables, self.kv_caches, self.state = items, tables, kv_caches, state
        n_kv = kv_caches[0][0].shape[2]
        for _, _, _, start, _, seq_id, prompt in items:
            if start == 0:
                state.start(seq_id, n_kv, max(prompt, state.capacity + 1))

    def __call__(self, layer: int, q: torch.Tensor, scale: float) -> None:
        pair, st = self.kv_caches[layer], self.state
        capacity, recent = st.capacity, st.recent
        for row, first, n, start, before, seq_id, prompt in self.items:
            acc, pos = (x[layer] for x in st.sequences[seq_id])  # [KVH, rows]
            end = before + n
            positions = torch.arange(start, start + n, device=acc.device)
            pos[:, before:end] = positions
            rows = sequence_rows(self.tables, row, end, pair[0].shape[1])
            acc[:, :end] += attention_mass(q[first:first + n], read_keys(pair, rows), pos[:, :end], positions, scale)
            if start + n == prompt and end > capacity:  # the prompt's end: heavy hitters and the recent ones stay
                heavy = acc[:, : end - recent].sort(dim=-1, descending=True, stable=True).indices
                tail = torch.arange(end - recent, end, device=acc.device).expand(acc.shape[0], recent)
                keep = torch.cat((heavy[:, : capacity - recent].sort(-1).values, tail), dim=1)
                move_rows(pair, rows, keep)
                acc[:, :capacity], pos[:, :capacity] = acc.gather(1, keep), pos.gather(1, keep)
                acc[:, capacity:] = 0
            elif start >= prompt and end > capacity:  # one token past the capacity: each head evicts one row
                old = pos[:, :end] <= start - recent
                victim = acc[:, :end].masked_fill(~old, float("inf")).argmin(-1)  # [KVH]
                heads = torch.arange(acc.shape[0], device=acc.device)
                for cache in pair:  # (fp8 as bytes: CPU indexing has no fp8 kernels)
                    flat = as_bytes(cache).flatten(0, 1)
                    flat[rows[victim], heads] = flat[rows[end - 1], heads]
                acc[heads, victim], pos[heads, victim] = acc[:, end - 1], pos[:, end - 1]
                acc[:, end - 1] = 0


class H2OEviction(CompactedBlocks):
    """The scheduler's side: prompts are admitted whole; past the prompt, one token a step (each step evicts); the
    host's count of the rows each sequence dropped, and the blocks freed after a prompt's compaction."""

    observes = True
    allows_graphs = False  # it scores every decode step beside attention, on the host's schedule

    def __init__(self, block_manager: BlockManager, budget_tokens: int, num_layers: int, device):
        self.block_manager, self.budget_tokens = block_manager, budget_tokens
        self.state = H2OState(budget_tokens, num_layers, device)  # each sequence's accumulated attention
        self.capacity = budget_tokens - 1
        self.budget = budget_tokens // block_manager.block_size  # blocks a sequence holds once its prompt is done
        self.whole_prompt = True  # ... and during its prefill, its whole prompt's

    def compaction(self, seq: Sequence, n: int) -> None:
        """Nothing for the batch to carry: every step under h2o is observed (`H2OObserver`)."""
        return None

    @staticmethod
    def observe_items(batch, cu) -> list[tuple[int, int, int, int, int, int, int]]:
        """Every row of the step as H2OObserver takes them: (batch row, first query's row, tokens, first position,
        rows cached before, seq_id, prompt length)."""
        return [(i, int(cu[i]), n, seq.num_computed_tokens, seq.num_computed_tokens - seq.num_dropped_tokens,
                 seq.seq_id, seq.num_prompt_tokens) for i, (seq, n) in enumerate(batch.items)]

    def observer(self, items, tables: torch.Tensor, kv_caches: list) -> H2OObserver:
        return H2OObserver(items, tables, kv_caches, self.state)

    def release(self, seq: Sequence) -> None:
        self.state.release(seq.seq_id)  # its accumulated attention goes with its blocks

    def after_step(self, batch) -> None:
        """What the step's observer did, on the host: a prompt compacted to `capacity` rows (its blocks past them
        freed), or one row evicted. num_computed_tokens is already past the step."""
        bm = self.block_manager
        for seq, n in batch.items:
            if seq.finished:
                continue
            start, prompt = seq.num_computed_tokens - n, seq.num_prompt_tokens
            if start + n == prompt and prompt > self.capacity:
                seq.num_dropped_tokens = prompt - self.capacity
                tail = seq.block_table[bm.blocks_for(self.capacity):]
                del seq.block_table[bm.blocks_for(self.capacity):]
                bm.release_blocks(tail)
            elif start >= prompt and start - seq.num_dropped_tokens + n > self.capacity:
                seq.num_dropped_tokens += n

    def make_room(self, seq: Sequence, position: int) -> None:
        """Nothing on the host: the observer evicts after the step's attention."""

    def admit_tokens(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens

    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """The prompt's chunks stop at its end; past it (a recompute), one token a step, as decode evicted."""
        start, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
        return min(n, prompt - start) if start < prompt else min(n, 1)

