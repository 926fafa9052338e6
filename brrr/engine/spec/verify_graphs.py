"""CUDA graphs of steps whose every row has the same number q of query tokens: a speculative verify step (each
row's last committed token and up to q - 1 drafts) and a draft model's catch-up step (the tokens the target kept
since its last proposal). On a small model a verify step is launch-bound: run eagerly, its launches cost what the
speculation gains.

One graph per captured batch size g, with cu_seqlens fixed at 0, q, 2q, ...: row i's tokens sit at i*q .. i*q+n-1,
n <= q, and its query slots after them are padding. Causal attention keeps padding invisible to the real tokens
before it; padding writes its K/V to the runner's spare block, takes the row's last real position (a valid RoPE
position) and its outputs are never read. Rows b .. g - 1 of a step of b rows are padding too (context q: no
cached prefix). With q >= 2 every row takes the varlen prefill kernel, whose launch depends only on the batch and q
(known at capture); its cached prefix (context - q keys) is read from the device, so one graph serves every
context length, unlike decode graphs, which need one per attention plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.spec.verify import device_draft_gather, write_device_drafts
from brrr.engine.staging import StepRecord, block_copies, index_in_row, stage
from brrr.kernels import AttnMeta

# Rows (g * q) of the largest verify graph: its logits (fp32, rows x vocab) and activations stay in the graph pool
# for the engine's life, beside the decode graphs' (at most max_num_seqs rows), and were not counted when the KV
# cache was sized. Speculation pays at small batch, where launches dominate; a batch this large is mostly matmul
# work, where a graph saves a small share.
MAX_VERIFY_GRAPH_ROWS = 512


@dataclass(frozen=True)
class VerifyGraphSpec:
    tokens: int  # q: query tokens per row (a verify step: num_speculative_tokens + 1)
    hidden: bool  # the graph also keeps every row's final hidden state (an EAGLE proposer reads them)
    max_batch: int  # the largest batch size captured


def verify_graph_spec(tokens: int, hidden: bool, max_num_seqs: int, max_num_batched_tokens: int,
                      disable_by_batch_size: int | None = None) -> VerifyGraphSpec | None:
    """The verify graphs an engine captures: up to the batch speculation runs at (disable_by_batch_size), whose
    padded step fits the token budget (what the KV cache was sized beside) and MAX_VERIFY_GRAPH_ROWS."""
    limit = min(max_num_seqs, disable_by_batch_size or max_num_seqs, max_num_batched_tokens // tokens,
                MAX_VERIFY_GRAPH_ROWS // tokens)
    return VerifyGraphSpec(tokens, hidden, limit) if limit >= 1 else None


def graph_replays(runner, proposer) -> dict:
    """Speculating steps that ran in graphs: the target's verify steps, and a draft model's steps (its own runner's
    decode and verify graphs) or an EAGLE head's proposals."""
    verify = runner.verify_graphs  # None: not captured (CPU, cuda_graphs off)
    stats = {"spec_verify_graph_steps": verify.replays if verify is not None else 0}
    steps = proposer.draft_graph_steps()
    if steps is not None:
        stats["spec_draft_graph_steps"] = steps
    return stats


class VerifyGraphs:
    def __init__(self, runner, spec: VerifyGraphSpec, sizes: list[int], max_blocks: int):
        """runner: the ModelRunner whose model, KV cache, spare block and row input the graphs use; sizes: the
        batch sizes to capture (ascending)."""
        self.runner, self.q, self.hidden = runner, spec.tokens, spec.hidden
        self.sizes = sizes
        self.replays = 0  # steps that ran through a verify graph (benches report it)
        n, q, dev = sizes[-1], self.q, runner.device
        spare = runner.num_blocks * runner.block_size
        # Every tensor a graph reads must outlive it: the graph keeps addresses, not references. Rows of an even
        # length: each of ids, positions and slots starts 16-byte aligned, as the eager step's do (Triton compiles a
        # kernel per pointer alignment).
        self.rows = torch.zeros(3, -(-n * q // 2) * 2, dtype=torch.long, device=dev)  # ids, positions, slots
        self.rows[2] = spare
        self.ctx = torch.full((n,), q, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.cu = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=dev)
        # outside the graph pool: a replay's hidden rows are copied out of it before the next one
        cfg = runner.model.config
        self.hidden_out = (torch.zeros(n * q, cfg.hidden_size, dtype=runner.dtype, device=dev) if self.hidden
                           else None)
        self.graphs: dict[int, tuple] = {}

    def capture(self, capture, pool):
        """Capture every size, largest first, into `pool` (the decode graphs'); returns the pool."""
        runner, q = self.runner, self.q
        for g in reversed(self.sizes):
            meta = AttnMeta(cu_seqlens_q=self.cu[: g + 1], seqlens_q=[q] * g, slot_mapping=self.rows[2, : g * q],
                            block_tables=self.tables[:g], kv_caches=runner.kv_caches, context_lens_t=self.ctx[:g])

            def step(g=g, meta=meta):
                if runner.row_input is not None:  # inside the graph: its input is buffer[:g * q]
                    runner.row_input.begin(g * q)
                hidden = runner.model(self.rows[0, : g * q], self.rows[1, : g * q], meta)
                if self.hidden_out is not None:
                    self.hidden_out[: g * q].copy_(hidden)
                return runner.model.compute_logits(hidden)

            step()  # warm-up: lazy buffers and kernel compilation happen outside the capture
            graph, logits = capture(step, pool)
            pool = graph.pool()
            self.graphs[g] = (graph, logits)
        if runner.row_input is not None:
            runner.row_input.end()
        return pool

    def takes(self, batch: ScheduledBatch) -> bool:
        """Whether a step fits a graph: at most the largest size's rows, none longer than q tokens, block tables
        within the captured width."""
        return (len(batch.items) <= self.sizes[-1]
                and all(n <= self.q and len(seq.block_table) <= self.tables.shape[1] for seq, n in batch.items))

    def replay(self, batch: ScheduledBatch, rows: list[int], want_hidden: bool):
        """(logits of the flattened step's `rows`, and with want_hidden its hidden states [tokens, hidden] in the
        flattened order, as `ModelRunner.execute` returns them), through the graph of the next size up (on every
        rank of a sharded model: the record is the runner's)."""
        record, drafts = self.record(batch, rows, want_hidden)
        return self.runner._run(record, drafts)

    def record(self, batch: ScheduledBatch, rows: list[int], want_hidden: bool):
        """Host staging: (the step's StepRecord, the device drafts its ids are completed with or None)."""
        runner, q, b = self.runner, self.q, len(batch.items)
        g = next(size for size in self.sizes if size >= b)
        ids, positions, slots, seqlens, context_lens, tables = runner._flatten(batch)
        n = np.asarray(seqlens)
        last = np.zeros(g, dtype=np.int64)
        last[:b] = np.asarray(context_lens) - 1
        # each real token's place in the graph: row i's n_i tokens at i*q onwards
        where = np.repeat(np.arange(b) * q, n) + index_in_row(n)
        host = np.empty((3, g * q), dtype=np.int64)
        host[0] = 0
        host[1] = np.repeat(last, q)  # padding at the row's last real position
        host[2] = runner.num_blocks * runner.block_size  # padding writes to the spare block
        host[0, where], host[1, where], host[2, where] = ids, positions, slots
        ctx = np.full(g, q, dtype=np.int32)  # the kernel reads context - q cached keys: the real rows' prefix
        ctx[:b] = np.asarray(context_lens) - n + q
        take = np.concatenate([where[rows], where if want_hidden else where[:0]])
        gather = device_draft_gather(batch)
        arrays = (host, ctx, tables, take, *((gather[1], where[gather[2]]) if gather else ()))
        record = StepRecord("verify", arrays, block_copies(batch.copies), size=g, rows=len(rows),
                            want_hidden=want_hidden, device_ids=gather is not None,
                            **runner.row_fields(batch, [q] * b, g * q))
        return record, None if gather is None else gather[0]

    def run(self, record, drafts):
        """Device execution of a verify record (every rank): (picked logits, hidden states or None)."""
        runner, g = self.runner, record.size
        rows_t, ctx_t, tables_t, take_t, *draft_index = stage(runner.device, *record.arrays)
        self.rows[:, : g * self.q].copy_(rows_t)
        if drafts is not None:  # drafts still on the device: their ids gathered there
            write_device_drafts(self.rows[0], drafts, *draft_index)
        runner._share_ids(record, self.rows[0, : g * self.q])
        self.ctx[:g].copy_(ctx_t)
        self.tables[: tables_t.shape[0], : tables_t.shape[1]].copy_(tables_t)
        runner.stage_rows(record)
        graph, logits = self.graphs[g]
        graph.replay()
        self.replays += 1
        picked = logits.index_select(0, take_t[: record.rows])
        hidden = self.hidden_out.index_select(0, take_t[record.rows:]) if record.want_hidden else None
        return picked, hidden
