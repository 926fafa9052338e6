"""CUDA graphs of an EAGLE proposal: the head's catch-up forward and its k draft steps in one graph per captured
batch size and decode-attention bound. Run eagerly, each of the k head steps (embedding, fc, one decoder layer,
the LM head, argmax) is a few dozen launches from Python, and a small target's round is then mostly launch time.

Layout of the graph of size g for k drafts (q = k + 1 query slots a row in the catch-up, as a verify graph's):
- catch-up: row i's n_i <= q new features and tokens at i*q .. i*q + n_i - 1, the rest of its q slots padding
  (token 0 at the row's last real position, K/V written to the head cache's spare block, outputs never read;
  causal attention keeps padding invisible to the real rows before it). Every row takes the varlen prefill kernel,
  which reads each row's cached prefix (context - q keys) on the device. Rows b .. g - 1 of a b-row call are
  padding with no cached prefix.
- k draft steps: each row's predicted feature at its last real slot, through the target's LM head, gives draft s;
  the next one-token step reads (draft s, that feature) at the positions, slots and context lengths the host wrote
  for step s. The decode kernel's launch depends on a context bound, so each size has one graph per bound of
  `decode_graph_plans` and a call replays the tightest one its longest context fits (as the runner's decode graphs).
The drafts land in a static [g, k] buffer; nothing in a replay waits for the host.
"""
from __future__ import annotations

import numpy as np
import torch

from brrr.engine.staging import index_in_row, stage
from brrr.kernels import AttnMeta
from brrr.kernels.attention import decode_graph_plans


def _even(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class EagleGraphs:
    def __init__(self, proposer, sizes: list[int], k: int, max_blocks: int):
        """proposer: the EagleProposer whose head, target and cache the graphs use (its pool must not move while
        they live); sizes: batch sizes to capture, ascending; max_blocks: the widest head block table."""
        self.proposer, self.sizes, self.k, self.q = proposer, sizes, k, k + 1
        self.replays = 0  # proposals that ran through a graph (stats: spec_draft_graph_steps)
        n, q, dev, bs = sizes[-1], self.q, proposer.device, proposer.block_size
        self.spare = proposer.spare_block * bs
        # One int64 and one int32 buffer, each section at a fixed offset sized for the largest batch (16-byte
        # aligned, as an eager step's arrays are: Triton specializes on pointer alignment): a call fills every
        # section for its size from one host array, in one copy each. int64: catch-up ids, positions, slots (n*q
        # each), each row's last real slot (n), step positions and slots ((k - 1) x n each). int32: catch-up context
        # (n), step contexts ((k - 1) x n).
        self.rows, self.steps = _even(n * q, 2), _even(n, 4)
        self.ints = torch.zeros(3 * self.rows + self.steps * (1 + 2 * (k - 1)), dtype=torch.long, device=dev)
        self.ints[2 * self.rows: 3 * self.rows] = self.spare  # what the captures write: no block of the pool
        self.ints[3 * self.rows + self.steps * k:] = self.spare
        self.ints32 = torch.ones(self.steps * k, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.features = torch.zeros(n * q, proposer.head.config.hidden_size, dtype=proposer.dtype, device=dev)
        self.cu = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=dev)
        self.cu1 = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros(n, k, dtype=torch.long, device=dev)
        self.graphs: dict[int, dict] = {}  # size -> decode plan -> graph

    # -- views of the static buffers (a graph of size g reads the first g entries of each section) ---------------
    def _rows(self, which: int, g: int) -> torch.Tensor:  # catch-up ids (0), positions (1), slots (2)
        return self.ints[which * self.rows: which * self.rows + g * self.q]

    def _per_row(self, section: int, g: int) -> torch.Tensor:  # last slot (0), step positions (1..), slots (k..)
        offset = 3 * self.rows + self.steps * section
        return self.ints[offset: offset + g]

    def _context(self, step: int, g: int) -> torch.Tensor:  # catch-up (0), draft step s (s + 1)
        return self.ints32[self.steps * step: self.steps * step + g]

    def capture(self, capture) -> None:
        """Capture every size (largest first) and decode bound into one pool. capture(step, pool) -> (graph, out):
        torch.cuda.graph's, or a test's eager stand-in."""
        prop, k, q, pool = self.proposer, self.k, self.q, None
        cfg, cache = prop.head.config, [(prop.k_cache, prop.v_cache)]
        width = self.tables.shape[1]
        for g in reversed(self.sizes):
            bounds = sorted({plan.max_context for plan in decode_graph_plans(
                g, width * prop.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, prop.dtype,
                prop.block_size, prop.device)}, reverse=True)
            for bound in bounds:
                catch_up = AttnMeta(cu_seqlens_q=self.cu[: g + 1], seqlens_q=[q] * g, slot_mapping=self._rows(2, g),
                                    block_tables=self.tables[:g], kv_caches=cache, context_lens_t=self._context(0, g))
                steps = [AttnMeta(cu_seqlens_q=self.cu1[: g + 1], seqlens_q=[1] * g,
                                  slot_mapping=self._per_row(k + s, g), block_tables=self.tables[:g], kv_caches=cache,
                                  context_lens_t=self._context(s + 1, g), max_context_len=bound)
                         for s in range(k - 1)]

                def step(g=g, catch_up=catch_up, steps=steps):
                    predicted = prop.head_forward(self._rows(0, g), self.features[: g * q], self._rows(1, g),
                                                  catch_up)
                    feature = predicted.index_select(0, self._per_row(0, g))
                    for s in range(k):
                        token = prop.draft_tokens(feature)
                        self.drafts[:g, s].copy_(token)
                        if s < k - 1:
                            feature = prop.head_forward(token, feature, self._per_row(1 + s, g), steps[s])
                    return self.drafts[:g]

                step()  # warm-up: lazy buffers (RoPE tables) and kernel compilation happen outside the capture
                graph, _ = capture(step, pool)
                pool = graph.pool()
                self.graphs.setdefault(g, {})[bound] = graph

    def takes(self, lengths: list[int], widths: list[int], k: int) -> bool:
        """Whether a call fits: this k, at most the largest size's rows, each with at most q new features and a
        block table within the captured width."""
        return (k == self.k and len(lengths) <= self.sizes[-1] and max(lengths) <= self.q
                and max(widths) <= self.tables.shape[1])

    def replay(self, layout, features: torch.Tensor) -> torch.Tensor:
        """The drafts [b, k] of a call laid out by `EagleProposer._layout` (a view of the static buffer: read it
        before the next replay), queued on the device without waiting for it."""
        k, q, b = self.k, self.q, len(layout.lengths)
        g = next(size for size in self.sizes if size >= b)
        n = np.asarray(layout.lengths)
        where = np.repeat(np.arange(b) * q, n) + index_in_row(n)
        ints = np.zeros(self.ints.shape[0], dtype=np.int64)
        rows = ints[: 3 * self.rows].reshape(3, self.rows)
        last = np.zeros(g, dtype=np.int64)  # each row's last real position: the padding's (a valid RoPE position)
        last[:b] = layout.positions[np.cumsum(n) - 1]
        rows[1, : g * q] = np.repeat(last, q)
        rows[2, : g * q] = self.spare
        rows[0, where], rows[1, where], rows[2, where] = layout.ids, layout.positions, layout.slots
        per_row = ints[3 * self.rows:].reshape(-1, self.steps)
        per_row[0, :b] = np.arange(b) * q + n - 1
        per_row[1:k, :b] = layout.step_positions
        per_row[k:, :g] = self.spare
        per_row[k:, :b] = layout.step_slots
        ints32 = np.ones((k, self.steps), dtype=np.int32)
        ints32[0, :g] = q  # the kernel reads context - q cached keys: the real rows' prefix, none for padding
        ints32[0, :b] = layout.context - n + q
        ints32[1:, :b] = layout.context[None, :] + 1 + np.arange(k - 1)[:, None]
        ints_t, ints32_t, tables_t, where_t = stage(self.proposer.device, ints, ints32.ravel(), layout.tables, where)
        self.ints.copy_(ints_t)
        self.ints32.copy_(ints32_t)
        self.tables[:b, : layout.tables.shape[1]].copy_(tables_t)
        self.features.index_copy_(0, where_t, features.to(self.features.dtype))
        longest = int(layout.context.max()) + k - 1
        graphs = self.graphs[g]
        graphs[graph_plan_for_bounds(tuple(graphs), longest)].replay()
        self.replays += 1
        return self.drafts[:b]


def graph_plan_for_bounds(bounds: tuple[int, ...], longest: int) -> int:
    """Of a size's captured context bounds, the tightest that `longest` fits (the loosest when none does)."""
    ordered = sorted(bounds)
    return next((c for c in ordered if longest <= c), ordered[-1])
