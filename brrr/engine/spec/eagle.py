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
"""
from __future__ import annotations

import torch

from brrr.engine.spec.proposer import Proposer, SpecInput
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.models.eagle import draft_logits, load_head

BLOCK_SIZE = 16


class _HeadState:
    """One sequence's head cache: positions start .. start + length - 1 are committed, in blocks[i // BLOCK_SIZE]."""

    def __init__(self, start: int):
        self.start, self.length, self.blocks = start, 0, []


class EagleProposer(Proposer):
    needs_hidden = True

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

    # -- blocks --------------------------------------------------------------------------------------------------
    def _grow(self):
        """Double the pool (copying what it holds): the head's cache is small next to the target's."""
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
        return self.k_cache.shape[0] - len(self.free)

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

    def _forward(self, states, token_ids, features, lengths, positions) -> torch.Tensor:
        """One head forward: for sequence i, lengths[i] new positions starting at positions[i] (cache index
        positions[i] - start), reading token_ids (a list, or the previous step's drafts still on the device: no
        sync between draft steps) and features; returns the predicted features."""
        slots, pos = [], []
        for st, n, p in zip(states, lengths, positions):
            self._reserve(st, p - st.start + n)
            for q in range(p, p + n):
                i = q - st.start
                slots.append(st.blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE)
                pos.append(q)
        width = max(len(st.blocks) for st in states)
        tables = torch.zeros(len(states), width, dtype=torch.int32)
        for b, st in enumerate(states):
            tables[b, :len(st.blocks)] = torch.tensor(st.blocks, dtype=torch.int32)
        cu = torch.zeros(len(states) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        meta = AttnMeta(cu_seqlens_q=cu.to(self.device), seqlens_q=list(lengths),
                        context_lens=[p - st.start + n for st, n, p in zip(states, lengths, positions)],
                        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                        block_tables=tables.to(self.device), kv_caches=[(self.k_cache, self.v_cache)])
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        embeds = self.target.model.embed_tokens(token_ids).to(self.dtype)
        positions_t = torch.tensor(pos, dtype=torch.long, device=self.device)
        return self.head(embeds, features.to(self.device, self.dtype), positions_t, meta)

    @torch.inference_mode()
    def propose(self, inputs: list[SpecInput], k: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inputs]
        live = [i for i, inp in enumerate(inputs) if inp.hidden is not None and len(inp.hidden)]
        if not live:
            return out
        states, ids, feats, lengths, starts = [], [], [], [], []
        for i in live:
            inp = inputs[i]
            n, L = len(inp.hidden), len(inp.token_ids)
            if n > L - 1:
                raise BrrrError(f"EAGLE proposer: sequence {inp.seq_id} got {n} hidden rows for {L} tokens (at most "
                                f"{L - 1}: one per position before the last token)")
            first = L - 1 - n
            states.append(self._state_for(inp, first))
            ids.extend(inp.token_ids[first + 1:])
            feats.append(inp.hidden)
            lengths.append(n)
            starts.append(first)
        predicted = self._forward(states, ids, torch.cat(feats), lengths, starts)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        feature = predicted.index_select(0, last)
        for st, n in zip(states, lengths):
            st.length += n  # real features: kept across calls; drafted positions below are not
        drafts = []
        positions = [len(inputs[i].token_ids) - 1 for i in live]
        for step in range(k):
            token = draft_logits(self.target, feature).argmax(-1)
            drafts.append(token)
            if step == k - 1:
                break
            feature = self._forward(states, token, feature, [1] * len(live), [p + step for p in positions])
        rows = torch.stack(drafts, 1).tolist() if drafts else [[] for _ in live]
        for i, row in zip(live, rows):
            out[i] = row
        return out
