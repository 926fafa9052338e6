"""SnapKV eviction inside the paged cache (Li et al., 2024): once, at the end of a prompt's prefill, each layer's KV
heads keep `budget` of the prompt's tokens, chosen by the attention the prompt's last W queries (the observation
window) give them; the rest go back to the block manager. Generated tokens are all kept, as in the paper.

The score of prompt position t for KV head h, over the window's queries i (prompt positions P - W .. P - 1) and the
query heads g of h's group (GQA):

    s[h, t] = sum_i sum_g softmax_t(q[i, g] . k[t, h] * scale, causal)          for t < P - W
    pooled  = max over t' in [t - 3, t + 3] of s[h, t']                          (max-pool, kernel 7)

Head h keeps the window itself and the top budget - W pooled positions (ties: the lower position), in original
order. Every head keeps as many, so they are compacted into the sequence's first `budget` cache rows and one block
table still serves all heads; the blocks past them are freed and `Sequence.num_dropped_tokens` = P - budget maps
later positions to rows. Keys were cached after RoPE, so the kept rows keep their original positions and decode
goes on from position P.

The scores and the compaction run in plain torch beside attention, on the cache's device (`SnapObserver`, the
AttnMeta.observe of the step that ends the prompt: each layer right after its attention, so that step's own
outputs, its first token included, saw the whole prompt). The window's queries must run in that one step, so a
prompt chunk never ends inside the window (`SnapKVEviction.prefill_chunk`). A preempted sequence recomputes its
prompt, compacts it the same way, then its generated tokens over the compacted cache: the same K/V it had.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.config import SNAPKV_WINDOW
from brrr.engine.block_manager import BlockManager
from brrr.engine.sequence import Sequence
from brrr.kernels.attention.kv_quant import as_bytes, dequantize, kv_scales

POOL_KERNEL = 7  # the paper's max-pool width over positions


def snapkv_scores(q_window: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q_window [W, H, D]: the prompt's last W queries (rotated); keys [P, KVH, D]: the prompt's cached keys ->
    [KVH, P - W] pooled scores of the positions before the window (float32)."""
    w, n_heads, dim = q_window.shape
    p, n_kv = keys.shape[0], keys.shape[1]
    q = q_window.float().view(w, n_kv, n_heads // n_kv, dim)
    logits = torch.einsum("wkgd,tkd->kgwt", q, keys.float()) * scale
    causal = torch.arange(p, device=keys.device)[None, :] > torch.arange(p - w, p, device=keys.device)[:, None]
    weights = logits.masked_fill(causal, float("-inf")).softmax(-1)
    scores = weights.sum((1, 2))[:, : p - w]  # [KVH, P - W]
    return F.max_pool1d(scores[:, None], POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)[:, 0]


def snapkv_keep(scores: torch.Tensor, window: int, kept: int) -> torch.Tensor:
    """[KVH, P - W] pooled scores -> [KVH, kept] the prompt positions each head keeps, ascending: the top
    kept - window by score (a stable sort: ties go to the lower position), then the window."""
    n_kv, before = scores.shape
    top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : kept - window].sort(-1).values
    tail = torch.arange(before, before + window, device=scores.device).expand(n_kv, window)
    return torch.cat((top, tail), dim=1)


def sequence_rows(tables: torch.Tensor, row: int, n: int, block_size: int) -> torch.Tensor:
    """The cache rows (block * block_size + offset, flat) of a step's table row's first n rows, in order."""
    blocks = tables[row, : -(-n // block_size)].long()
    return (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()[:n]


def read_keys(pair, rows: torch.Tensor) -> torch.Tensor:
    """A layer's cached keys at flat rows, in float32 (an fp8 cache's dequantized, as attention reads them)."""
    k_cache = pair[0]
    keys = as_bytes(k_cache).flatten(0, 1).index_select(0, rows)
    scales = kv_scales(pair)
    return keys.float() if scales is None else dequantize(keys.view(k_cache.dtype), scales[0], torch.float32)


def move_rows(pair, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """Head h's K/V at rows[keep[h, j]] into rows[j], for j < keep.shape[1], every head at once."""
    kept, n_kv = keep.shape[1], keep.shape[0]
    for cache in pair:  # (fp8 as bytes: CPU indexing has no fp8 kernels)
        flat = as_bytes(cache).flatten(0, 1)
        gather = keep.t()[:, :, None].expand(kept, n_kv, cache.shape[3])
        flat[rows[:kept]] = flat.index_select(0, rows).gather(0, gather)


class SnapObserver:
    """AttnMeta.observe for a step that ends prompts which compact: after each layer's attention, each such
    sequence's kept K/V rows move to its first `kept` cache rows. compactions: (batch row, first window query's
    row in the flattened step, window, prompt length, kept) each; tables: the step's block tables on the device."""

    def __init__(self, compactions: list[tuple[int, int, int, int, int]], tables: torch.Tensor, kv_caches: list):
        self.compactions, self.tables, self.kv_caches = compactions, tables, kv_caches

    def __call__(self, layer: int, q: torch.Tensor, scale: float) -> None:
        pair = self.kv_caches[layer]
        for row, first, window, prompt, kept in self.compactions:
            rows = sequence_rows(self.tables, row, prompt, pair[0].shape[1])
            scores = snapkv_scores(q[first:first + window], read_keys(pair, rows), scale)
            move_rows(pair, rows, snapkv_keep(scores, window, kept))


class CompactedBlocks:
    """Block bookkeeping of a policy that compacts a sequence's kept rows to the front of its cache (SnapKV, H2O):
    position p lives at row p - num_dropped_tokens, so blocks are counted on rows, not positions."""
    block_manager: BlockManager
    plans_decodes = True  # (StreamingEviction's)

    def needs_block(self, seq: Sequence, end: int) -> bool:
        return self.block_manager.blocks_for(end - seq.num_dropped_tokens) > len(seq.block_table)

    def grow(self, seq: Sequence, end: int) -> None:
        """Blocks for positions up to end - 1 (prefill_chunk kept them within the free ones)."""
        bm = self.block_manager
        while len(seq.block_table) < bm.blocks_for(end - seq.num_dropped_tokens):
            seq.block_table.append(bm.allocate_block())


class SnapKVEviction(CompactedBlocks):
    """The scheduler's side: which prompts compact (those longer than the budget), the prefill chunks that keep
    each window in one step, the blocks a chunk needs, and the blocks freed after the compaction; the runner's:
    the compactions a step carries (`observe_items`) and the observer that does them (`observer`)."""
    observes = allows_graphs = True
    plans_decodes = False  # one compaction at the prompt's end; decode steps keep every new row

    def __init__(self, block_manager: BlockManager, budget_tokens: int):
        self.block_manager, self.budget_tokens = block_manager, budget_tokens
        self.budget = None  # no cap on a sequence's blocks below its length's: its generated tokens are all kept
        self.whole_prompt = True  # its prefill holds the whole prompt's blocks

    def window(self, seq: Sequence) -> int:
        return min(SNAPKV_WINDOW, seq.num_prompt_tokens, self.budget_tokens)

    def compaction(self, seq: Sequence, n: int) -> tuple[int, int] | None:
        """(window, kept) when the chunk of n tokens from num_computed_tokens ends a prompt that compacts."""
        start, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
        if prompt <= self.budget_tokens or not start < prompt == start + n:
            return None
        return self.window(seq), self.budget_tokens

    @staticmethod
    def observe_items(batch, cu) -> list[tuple[int, int, int, int, int]]:
        """The step's compactions as a StepRecord carries them: (batch row, first window query's row, window,
        prompt length, kept); the window is the last queries of the row's chunk."""
        if not batch.eviction:
            return []
        row_of = {seq: i for i, (seq, _) in enumerate(batch.items)}
        return [(row_of[seq], int(cu[row_of[seq] + 1]) - window, window, seq.num_prompt_tokens, kept)
                for seq, window, kept in batch.eviction]

    @staticmethod
    def observer(items, tables: torch.Tensor, kv_caches: list) -> "SnapObserver":
        return SnapObserver(items, tables, kv_caches)

    def release(self, seq: Sequence) -> None:
        """Nothing kept per sequence beyond its blocks and num_dropped_tokens."""

    def after_step(self, batch) -> None:
        """After the step that compacted prompts: each one's blocks past its kept rows go back to the pool."""
        bm = self.block_manager
        for seq, _, kept in batch.eviction:
            if seq.finished:
                continue
            tail = seq.block_table[bm.blocks_for(kept):]
            del seq.block_table[bm.blocks_for(kept):]
            bm.release_blocks(tail)
            seq.num_dropped_tokens = seq.num_prompt_tokens - kept

    def make_room(self, seq: Sequence, position: int) -> None:
        """Nothing goes during decode."""

    def admit_tokens(self, seq: Sequence) -> int:
        """A sequence is admitted with its prompt's blocks: the window's queries attend to the whole prompt."""
        return seq.num_prompt_tokens

    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """The largest chunk of at most n tokens from num_computed_tokens: the prompt's chunks stop at its end and,
        when it compacts, never inside the window (0: the window does not fit this step's tokens, it waits); a
        recompute's generated tokens take what the free blocks hold."""
        bm, start, prompt = self.block_manager, seq.num_computed_tokens, seq.num_prompt_tokens
        if start >= prompt:
            room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - (start - seq.num_dropped_tokens)
            return max(0, min(n, room))
        n = min(n, prompt - start)
        window_start = prompt - self.window(seq)
        if prompt > self.budget_tokens and window_start < start + n < prompt:
            n = max(0, window_start - start)
        return n

