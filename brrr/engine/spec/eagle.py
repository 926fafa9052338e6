"""EAGLE proposer: a one-layer head (brrr/models/eagle.py) that drafts k tokens from the target's hidden states.

Per sequence the head keeps the K/V of the positions it has read with the target's real features, in blocks of
its own small paged cache (one layer; brrr's attention reads it through AttnMeta like the target's). Head
position p reads (t_{p+1}, f_p), so with L tokens the target's features reach position L - 2 and the head's
committed positions are start .. L - 2 (start > 0 when the target skipped a cached prefix, whose features the
head never saw; it then attends to what it has). Each propose call:
  1. drops every head position from the first new feature's position on: the drafts of the previous call (the
     engine's rejections need no other rollback) and any overlap with rows the engine sends again;
  2. reads the new features in one varlen forward over all sequences; the last row's predicted feature through
     the target's LM head is draft token 1;
  3. runs k - 1 single-token steps, each reading (the previous draft, the previous predicted feature).
Drafts are greedy (argmax): under sampling the engine's rejection rule treats them as one-hot proposals.

The steps run in CUDA graphs when the engine captures them (eagle_graphs.py): the host lays out a call once
(`_layout`: block reservations, positions, slots, context lengths for the catch-up and every draft step) and stages
it in one copy; the eager path (CPU, steps no graph takes) runs from the same layout without waiting for the device.
The drafts stay on the device (`propose_on_device`): the engine's verify step gathers them there and reads them
with its own tokens, so a round waits for the device once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from brrr.engine.model_runner import _cuda_capture, graph_sizes
from brrr.engine.spec.eagle_graphs import EagleGraphs
from brrr.engine.spec.proposer import Proposer, SpecInput
from brrr.engine.spec.verify import DeviceDrafts
from brrr.engine.spec.verify_graphs import verify_graph_spec
from brrr.engine.staging import index_in_row, pad_tables, stage
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.sampling import greedy_argmax
from brrr.models.eagle import draft_logits, load_head

log = logging.getLogger("brrr.engine")
BLOCK_SIZE = 16


@dataclass
class ProposalLayout:
    """One propose call on the host, for b sequences and k drafts: the catch-up forward's rows (each sequence's n_i
    new features, in order), then k - 1 one-token steps."""
    ids: np.ndarray  # [sum n] int64: the token after each feature's position
    positions: np.ndarray  # [sum n] int64
    slots: np.ndarray  # [sum n] int64: head-cache slots
    lengths: list[int]  # n_i
    context: np.ndarray  # [b] int32: the head's cached positions once the new ones are in (step s: + s + 1)
    tables: np.ndarray  # [b, width] int32: head blocks, reserved for the draft steps too
    step_positions: np.ndarray  # [k - 1, b] int64
    step_slots: np.ndarray  # [k - 1, b] int64


class _HeadState:
    """One sequence's head cache: positions start .. start + length - 1 are committed, in blocks[i // BLOCK_SIZE]."""

    def __init__(self, start: int):
        self.start, self.length, self.blocks = start, 0, []


class EagleProposer(Proposer):
    needs_hidden = True
    device_drafts = True

    def __init__(self, head, target, initial_blocks: int = 64):
        """head: an EAGLE head directory (checked against `target`) or a loaded EagleHead; target: the model the
        engine serves (its embedding and LM head are the head's)."""
        self.target = target
        self.head = load_head(head, target) if not isinstance(head, torch.nn.Module) else head
        self.head.check_target(target)
        cfg = self.head.config
        weight = target.model.embed_tokens.weight
        self.device, self.dtype = weight.device, next(self.head.parameters()).dtype
        shape = (initial_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.free = list(range(initial_blocks - 1, -1, -1))
        self.seqs: dict[int, _HeadState] = {}
        self.block_size = BLOCK_SIZE
        self.spare_block: int | None = None  # with graphs: a block outside the pool, where padding writes
        self.graphs: EagleGraphs | None = None

    def draft_graph_steps(self) -> int:
        return self.graphs.replays if self.graphs is not None else 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        """The head's cache for block_size tokens (one layer: the engine counts it beside the target's)."""
        cfg = self.head.config
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def allocate_cache(self, num_blocks: int, block_size: int, cuda_graphs: bool, max_batch: int,
                       max_num_batched_tokens: int, k: int, max_model_len: int) -> None:
        """With cuda_graphs on CUDA: a fixed pool for as many tokens as the target's (num_blocks of block_size), a
        margin for each sequence's last partial block and drafts, and the proposal graphs up to the batch the
        verify graphs take. Otherwise the pool grows as sequences need it."""
        spec = verify_graph_spec(k + 1, True, max_batch, max_num_batched_tokens)
        # dynamic NTK RoPE reads the longest position on the host each step, which a graph cannot replay
        if not cuda_graphs or self.device.type != "cuda" or spec is None or self.head.config.rope.type == "dynamic":
            return
        blocks = -(-num_blocks * block_size // BLOCK_SIZE) + max_batch * (2 + k // BLOCK_SIZE)
        self.capture_graphs(spec.max_batch, k, -(-(max_model_len + k) // BLOCK_SIZE), blocks)

    @torch.inference_mode()
    def capture_graphs(self, max_batch: int, k: int, max_blocks: int, num_blocks: int | None = None,
                       capture=None) -> None:
        """Capture the proposal of k drafts for batch sizes up to max_batch (the decode graphs' sizes) over a new
        pool of num_blocks (the current size when None) and a spare block; no sequence may hold blocks yet.
        capture(step, pool) -> (graph, output): torch.cuda.graph's (tests pass one that re-runs the step)."""
        if self.seqs:
            raise BrrrError("EAGLE proposer: graphs are captured before any sequence is proposed for")
        blocks = num_blocks or self.k_cache.shape[0]
        shape = (blocks + 1, *self.k_cache.shape[1:])
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.free, self.spare_block = list(range(blocks - 1, -1, -1)), blocks
        self.graphs = EagleGraphs(self, graph_sizes(max_batch), k, max_blocks)
        self.graphs.capture(capture or (lambda step, pool: _cuda_capture(step, pool, self.device)))

    # -- blocks --------------------------------------------------------------------------------------------------
    def _grow(self):
        """Double the pool (copying what it holds): the head's cache is small next to the target's. Graphs read the
        pool where it was: a pool sized for the target's tokens should not grow, and if it does they are dropped."""
        if self.graphs is not None:
            log.warning("EAGLE proposer: its cache pool grew; proposals run eagerly from now on")
            self.graphs = None
        n = self.k_cache.shape[0]
        self.k_cache = torch.cat([self.k_cache, torch.zeros_like(self.k_cache)])
        self.v_cache = torch.cat([self.v_cache, torch.zeros_like(self.v_cache)])
        self.free.extend(range(2 * n - 1, n - 1, -1))

    def _reserve(self, st: _HeadState, positions: int):
        """Blocks for `positions` cached positions; blocks beyond them go back to the pool."""
        need = -(-positions // BLOCK_SIZE)
        while len(st.blocks) > need:
            self.free.append(st.blocks.pop())
        while len(st.blocks) < need:
            if not self.free:
                self._grow()
            st.blocks.append(self.free.pop())

    def release(self, seq_id: int) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is not None:
            self.free.extend(reversed(st.blocks))

    def blocks_in_use(self) -> int:
        return self.k_cache.shape[0] - len(self.free) - (self.spare_block is not None)

    # -- drafting ------------------------------------------------------------------------------------------------
    def _state_for(self, inp: SpecInput, first: int) -> _HeadState:
        """The sequence's state truncated to the positions before `first`; a fresh one when the cache does not
        reach `first` (the engine skipped features: a preemption it recomputed, say)."""
        st = self.seqs.get(inp.seq_id)
        if st is None or not st.start <= first <= st.start + st.length:
            self.release(inp.seq_id)
            st = self.seqs[inp.seq_id] = _HeadState(first)
        st.length = first - st.start
        return st

    def _layout(self, inputs: list[SpecInput], live: list[int], k: int) -> tuple[ProposalLayout, torch.Tensor]:
        """The call's host-side layout, with the blocks for its k - 1 draft steps reserved, and the new features
        of every live sequence in order. Marks the new features' positions committed (they are real: kept across
        calls); the drafted positions after them are not."""
        states, ids, feats, lengths, firsts = [], [], [], [], []
        for i in live:
            inp = inputs[i]
            n, L = len(inp.hidden), len(inp.token_ids)
            if n > L - 1:
                raise BrrrError(f"EAGLE proposer: sequence {inp.seq_id} got {n} hidden rows for {L} tokens (at most "
                                f"{L - 1}: one per position before the last token)")
            first = L - 1 - n
            st = self._state_for(inp, first)
            self._reserve(st, L - 1 - st.start + k - 1)
            states.append(st)
            ids.extend(inp.token_ids[first + 1:])
            feats.append(inp.hidden)
            lengths.append(n)
            firsts.append(first)
        bs, b = BLOCK_SIZE, len(states)
        tables = np.zeros((b, max(len(st.blocks) for st in states)), dtype=np.int32)
        for r, st in enumerate(states):
            tables[r, :len(st.blocks)] = st.blocks
        n = np.asarray(lengths)
        start = np.array([st.start for st in states], dtype=np.int64)
        row = np.repeat(np.arange(b), n)
        positions = np.repeat(np.asarray(firsts, dtype=np.int64), n) + index_in_row(n)
        context = (np.asarray(firsts) + n - start).astype(np.int32)  # cached positions once the new ones are in
        step_positions = np.asarray(firsts, dtype=np.int64) + n + np.arange(k - 1)[:, None]  # [k - 1, b]
        index, step_index = positions - start[row], step_positions - start
        slots = tables[row, index // bs].astype(np.int64) * bs + index % bs
        step_slots = tables[np.arange(b), step_index // bs].astype(np.int64) * bs + step_index % bs
        for st, m in zip(states, lengths):
            st.length += m
        layout = ProposalLayout(np.asarray(ids, dtype=np.int64), positions, slots, lengths, context, tables,
                                step_positions, step_slots)
        return layout, torch.cat(feats) if len(feats) > 1 else feats[0]

    def head_forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                     meta: AttnMeta) -> torch.Tensor:
        """One head forward over the (token, feature) pairs at `positions`: the predicted features."""
        embeds = self.target.model.embed_tokens(token_ids).to(self.dtype)
        return self.head(embeds, features.to(self.dtype), positions, meta)

    def draft_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """The greedy draft after each predicted feature, through the target's LM head (on the device)."""
        return greedy_argmax(draft_logits(self.target, features))

    def _propose_eager(self, lay: ProposalLayout, features: torch.Tensor, k: int) -> torch.Tensor:
        """The drafts [b, k] on the device, the call's inputs staged in one copy: no host wait inside."""
        b = len(lay.lengths)
        tables = pad_tables(lay.tables)
        cu = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(lay.lengths, out=cu[1:])
        step_context = lay.context[None, :] + 1 + np.arange(k - 1, dtype=np.int32)[:, None]
        ids, positions, slots, cu_t, context_t, tables_t, last, cu1, step_positions, step_slots, step_context_t = \
            stage(self.device, lay.ids, lay.positions, lay.slots, cu, lay.context, tables, cu[1:].astype(np.int64) - 1,
                  np.arange(b + 1, dtype=np.int32), lay.step_positions, lay.step_slots, step_context)
        cache = [(self.k_cache, self.v_cache)]
        meta = AttnMeta(cu_seqlens_q=cu_t, seqlens_q=list(lay.lengths), context_lens=lay.context.tolist(),
                        slot_mapping=slots, block_tables=tables_t, kv_caches=cache, context_lens_t=context_t)
        feature = self.head_forward(ids, features, positions, meta).index_select(0, last)
        drafts = []
        for s in range(k):
            token = self.draft_tokens(feature)
            drafts.append(token)
            if s == k - 1:
                break
            meta = AttnMeta(cu_seqlens_q=cu1, seqlens_q=[1] * b, context_lens=step_context[s].tolist(),
                            slot_mapping=step_slots[s], block_tables=tables_t, kv_caches=cache,
                            context_lens_t=step_context_t[s])
            feature = self.head_forward(token, feature, step_positions[s], meta)
        return torch.stack(drafts, 1)

    @torch.inference_mode()
    def propose_on_device(self, inputs: list[SpecInput], k: int) -> DeviceDrafts:
        """The drafts of every input with new features, queued on the device: nothing here waits for it."""
        live = [i for i, inp in enumerate(inputs) if inp.hidden is not None and len(inp.hidden)]
        rows: list[int | None] = [None] * len(inputs)
        if not live:
            return DeviceDrafts(torch.zeros(0, k, dtype=torch.long, device=self.device), rows)
        lay, features = self._layout(inputs, live, k)
        graphs = self.graphs
        if graphs is not None and graphs.takes(lay.lengths, [lay.tables.shape[1]], k):
            drafts = graphs.replay(lay, features)
        else:
            drafts = self._propose_eager(lay, features, k)
        for r, i in enumerate(live):
            rows[i] = r
        return DeviceDrafts(drafts, rows)

    def propose(self, inputs: list[SpecInput], k: int) -> list[list[int]]:
        return self.propose_on_device(inputs, k).lists()  # one wait for the device
