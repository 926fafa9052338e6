"""ModelRunner: owns the paged KV cache and turns a scheduled step into one flattened varlen forward pass.

A step runs in three parts. Host staging (rank 0: it holds the scheduler's state) flattens the ScheduledBatch into a
`StepRecord`: numpy arrays and ints, a feature's per-row input included (`RowInput`, which the runner stages without
knowing what it is). Device execution (`run_step`, every rank) stages the record in one copy and runs the forward,
or replays a decode or verify graph. Sampling (rank 0) reads the logits. With tensor parallelism the same
ModelRunner runs on every rank over its shard and its KV cache (the block ids are rank 0's for all), as nano-vllm
does: rank 0 sends each record to the workers before running it itself, one host message per worker per step
(`model.tp_group`, brrr/distributed/tp_group.py), and the collectives inside the forward pair up. Ids that exist
only on rank 0's device (a step launched before the host read the previous step's tokens, drafts left on the device)
are broadcast from there on the device.
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from brrr.analysis.model import kv_elements_per_token
from brrr.engine.sampler import PendingTokens, SampleResult, SampleRow, draw, h2d, sample
from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.spec.verify import device_draft_gather, write_device_drafts
from brrr.engine.spec.verify_graphs import VerifyGraphs, VerifyGraphSpec
from brrr.engine.staging import RowInput, StepRecord, block_copies, pad_tables, stage
from brrr.engine.swap import host_runs
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.attention import DecodePlan, decode_graph_plans, graph_plan_for
from brrr.kernels.attention.kv_quant import FP8, QuantKV, as_bytes, cache_dtype
from brrr.kernels.graph_inputs import stage_decode_inputs


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens (the count lives in brrr.analysis, with every other)."""
    return block_size * kv_elements_per_token(cfg) * dtype.itemsize


def kv_cache_bytes(free: int, total: int, in_use: int, activations: int, gpu_memory_utilization: float) -> int:
    """What the KV cache may take: this process's share, total * utilization, less what it holds (in_use: torch's
    memory, the weights) and the activations of a full-budget step; but never more than the device has free now
    (the driver's count: the CUDA context, other processes) less those activations."""
    return int(min(total * gpu_memory_utilization - in_use, free) - activations)


GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured for steps of up to max_batch rows (ascending): GRAPH_SIZES below it, and itself."""
    return [b for b in GRAPH_SIZES if b < max_batch] + [max_batch]


def _cuda_capture(step, pool, device):
    # No garbage collection during a capture: an unreachable engine's graphs and buffers freed mid-capture (a CUDA
    # graph destroyed, a tensor released) invalidate it (`capture_here` collects once before it starts).
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    # A capture stream of this runner's device: torch.cuda.graph's default one is made once per process, on the
    # device of the first capture, and entering it makes that device current (a disaggregated engine's decode
    # instance on GPU 1, in a process that captured on GPU 0 before, then launched its kernels against GPU 0).
    # thread_local: the engine's other threads (a disaggregated engine's KV transfers, the mask thread) may call
    # CUDA while this one captures; in the default global mode such a call breaks the capture.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            logits = step()
    finally:
        if was_enabled:
            gc.enable()
    return graph, logits


class ModelRunner:
    def __init__(self, model, block_size: int, num_blocks: int, max_model_len: int | None = None,
                 cuda_graphs: bool = False, max_graph_batch: int = 256, row_input: RowInput | None = None,
                 verify: VerifyGraphSpec | None = None, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False, num_host_blocks: int = 0):
        """row_input: a feature's per-row input the model reads (staging.RowInput); each batch its items' values.
        verify: the graphs of steps of several tokens a row to capture beside the decode graphs (spec/verify_graphs.py).
        kv_cache_dtype: EngineConfig's ("auto": the model's dtype; fp8 ones hold each layer's pair as a `QuantKV`
        with scales 1.0, or with calculate_kv_scales set from the first prefill's amax, after the graph captures).
        A tensor-parallel shard (rank 0's model carries `tp_group`, the handle on the workers) starts the same
        runner on every worker first, then captures on every rank.
        num_host_blocks: the host blocks swap preemption copies preempted sequences' K/V to (pinned beside a CUDA
        cache, copied on a stream of their own; `swap_blocks`); 0: none."""
        self.model, self.block_size, self.num_blocks, self.row_input = model, block_size, num_blocks, row_input
        self.verify_spec, self.verify_graphs = verify, None
        self.decode_replays = 0  # steps that ran through a decode graph
        # an eviction policy that scores attention (snapkv, h2o): each eager step's `observe_items` go to its
        # `observer`, which runs after every layer's attention (AttnMeta.observe); None: nothing observed
        self.attention_observer = None
        self.tp = getattr(model, "tp_group", None)  # rank 0 of a sharded model: its workers (None elsewhere)
        self.comm = getattr(model, "tp_comm", None)  # any rank of a sharded model: the group's collectives
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config
        self.kv_dtype = cache_dtype(kv_cache_dtype, self.dtype)
        if self.kv_dtype in FP8 and cfg.kv_lora_rank:
            raise BrrrError(f"kv_cache_dtype {kv_cache_dtype!r}: the latent cache of {cfg.architecture} (MLA) is "
                            "kept in the model's dtype; use 'auto'")
        self.kv_caches = self._new_kv_caches()
        self.host_caches = self._new_host_caches(num_host_blocks)
        self.swap_stream = torch.cuda.Stream(self.device) if num_host_blocks and self.device.type == "cuda" else None
        # batch size -> decode plan -> (graph, logits, meta): a size's graphs, one per context bound its attention
        # kernels are planned for (`decode_graph_plans`)
        self.graphs: dict[int, dict[DecodePlan, tuple]] = {}
        self.captured = None  # capture_cuda_graphs' arguments: wake captures again over the new cache
        if self.tp is not None:
            self.tp.start(dict(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                               max_graph_batch=max_graph_batch, verify=verify, kv_cache_dtype=kv_cache_dtype,
                               calculate_kv_scales=calculate_kv_scales,
                               row_input=None if row_input is None else row_input.for_workers()))
            if self.device.type == "cuda":  # before any capture: the graphs hold the chosen all-reduce
                self.choose_all_reduce(max_graph_batch)
        # Dynamic NTK RoPE reads the longest position on the host each step, which a graph cannot replay.
        if cuda_graphs and self.device.type == "cuda" and cfg.rope.type != "dynamic":
            self.capture_cuda_graphs(max_graph_batch, -(-(max_model_len or cfg.max_context) // block_size))
        if calculate_kv_scales and self.kv_dtype in FP8:  # after the captures: their warm-up steps' data sets nothing
            for layer in self.kv_caches:
                layer.pending = True

    # ---- every rank ---------------------------------------------------------------------------------------------
    def _every_rank(self, method: str, *args):
        """runner.method(*args) here, and first on every worker when this is rank 0 of a sharded model."""
        if self.tp is None:
            return getattr(self, method)(*args)
        return self.tp.call(self, method, *args)

    def _run(self, record: StepRecord, source=None):
        """Device execution of a staged step on every rank (`run_step`); source: rank 0's device-only inputs."""
        if self.tp is None:
            return self.run_step(record, source)
        return self.tp.step(self, record, source)

    @property
    def failure(self) -> str | None:
        """Why the runner can take no more steps (a tensor-parallel worker died, a collective failed), or None. The
        engine process's loop stops on it, so the server's /health answers 503."""
        return None if self.tp is None else self.tp.down

    @property
    def workers(self):
        """A sharded model's worker processes (tp_worker.WorkerGroup), or None."""
        return None if self.tp is None else self.tp.workers

    def release_graphs(self) -> None:
        """Drop the captured graphs (on every rank). Before a process group whose collectives they captured closes:
        one destroyed after its group (at interpreter exit) aborts the process (pytorch/pytorch#115388)."""
        if self.tp is not None and self.tp.down is None:
            self.tp.call(self, "drop_graphs")
        else:
            self.drop_graphs()
        self.captured = None

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.verify_graphs = None

    def capture_cuda_graphs(self, max_batch: int, max_blocks: int, capture=None) -> None:
        """Capture one decode step per batch size (largest first, one shared memory pool), on every rank in the same
        order. A step of B sequences replays the smallest graph >= B with the extra rows padded (writing to the spare
        block). With a verify spec, then the verify graphs of the sizes up to its bound, in the same pool.
        capture(step, pool) -> (graph, logits): torch.cuda.graph's (tests pass one that re-runs the step eagerly;
        picklable under tensor parallelism: the workers run it too)."""
        self.captured = (max_batch, max_blocks, capture)
        self._every_rank("capture_here", max_batch, max_blocks, capture)

    @torch.inference_mode()
    def capture_here(self, max_batch: int, max_blocks: int, capture=None) -> None:
        gc.collect()  # what an earlier engine left is freed now, not in the middle of a capture
        sizes = graph_sizes(max_batch)
        n, dev = sizes[-1], self.device
        self.g_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), self.num_blocks * self.block_size, dtype=torch.long, device=dev)
        self.g_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.g_ctx = torch.ones(n, dtype=torch.int32, device=dev)
        # Every tensor a graph reads must outlive it: the graph keeps addresses, not references.
        self.g_cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        pool = None
        # Per size, a graph for each context bound the attention plan distinguishes (the tightest one a step's longest
        # context fits is replayed); the loosest first.
        cfg = self.model.config
        for g in reversed(sizes):
            plans = decode_graph_plans(g, max_blocks * self.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       self.dtype, self.block_size, dev)
            for plan in plans:
                meta = AttnMeta(cu_seqlens_q=self.g_cu[: g + 1], seqlens_q=[1] * g, slot_mapping=self.g_slots[:g],
                                block_tables=self.g_tables[:g], kv_caches=self.kv_caches,
                                context_lens_t=self.g_ctx[:g], max_context_len=plan.max_context)

                def step(g=g, meta=meta):
                    if self.row_input is not None:  # inside the graph: its input is buffer[:g]
                        self.row_input.begin(g)
                    return self.model.logits(self.g_ids[:g], self.g_pos[:g], meta)

                step()  # warm-up: lazy buffers (RoPE tables) are made outside the capture
                graph, logits = capture(step, pool) if capture else _cuda_capture(step, pool, dev)
                pool = graph.pool()
                self.graphs.setdefault(g, {})[plan] = (graph, logits, meta)
        if self.row_input is not None:
            self.row_input.end()
        if self.verify_spec is not None:
            verify = graph_sizes(min(max_batch, self.verify_spec.max_batch))
            self.verify_graphs = VerifyGraphs(self, self.verify_spec, verify, max_blocks)
            self.verify_graphs.capture(capture or (lambda step, p: _cuda_capture(step, p, dev)), pool)

    def copy_blocks(self, copies) -> None:
        """Copy KV blocks (src, dst) on every rank."""
        if copies:
            self._every_rank("copy_here", block_copies(copies))

    def _new_kv_caches(self) -> list:
        """Every layer's (K, V) cache, zeroed; fp8 ones carry their scales (QuantKV). One block more than the block
        manager hands out: padded rows of a captured graph write there."""
        cfg = self.model.config
        heads, k_dim, v_dim = cfg.kv_cache_dims  # MLA: one latent row per token, no separate values
        shape = (self.num_blocks + 1, self.block_size, heads)
        pair = QuantKV if self.kv_dtype in FP8 else lambda k, v: (k, v)
        return [pair(torch.zeros(*shape, k_dim, dtype=self.kv_dtype, device=self.device),
                     torch.zeros(*shape, v_dim, dtype=self.kv_dtype, device=self.device)) for _ in range(cfg.num_layers)]

    def _new_host_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's host (K, V) blocks, shaped and typed as the device cache's, uninitialised (only what a
        swap-out wrote is ever read back)."""
        if not num_blocks:
            return []
        pin = self.device.type == "cuda"  # (asynchronous copies need page-locked memory; pinning needs CUDA)
        return [tuple(torch.empty(num_blocks, *t.shape[1:], dtype=t.dtype, pin_memory=pin) for t in pair)
                for pair in self.kv_caches]

    @torch.inference_mode()
    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy (device, host) block pairs out, then (host, device) pairs in, every layer's K and V as bytes (an
        fp8 cache's scales are per layer and stay). A sequence's device blocks lie anywhere in the pool, so each
        tensor goes through one gather (or scatter) on the device into contiguous staging rows, and crosses the
        host link in one copy per run of consecutive host blocks: on an H200 one copy per 32 KiB block ran at
        3.6 GB/s, runs of 32 blocks at 50 GB/s. On CUDA on the swap stream: it first waits for the compute
        stream's queued work (a step still in flight may write a block about to be copied), and the compute
        stream waits for its event before its next kernel (a freed block is reused, a swapped-in one read); the
        host waits for neither. On CPU the same copies, synchronous."""
        outs, ins = sorted(swap_out, key=lambda pair: pair[1]), sorted(swap_in)  # in host order
        stream = self.swap_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            out_rows, out_runs = self._staging_plan([d for d, _ in outs], [h for _, h in outs], stream)
            in_rows, in_runs = self._staging_plan([d for _, d in ins], [h for h, _ in ins], stream)
            asynchronous = stream is not None
            for device_pair, host_pair in zip(self.kv_caches, self.host_caches):
                for dev, host in zip(device_pair, host_pair):
                    if not dev.numel():  # (MLA's empty value cache)
                        continue
                    dev, host = as_bytes(dev), as_bytes(host)
                    if outs:
                        staged = dev.index_select(0, out_rows)
                        for first, row, n in out_runs:
                            host[first:first + n].copy_(staged[row:row + n], non_blocking=asynchronous)
                    if ins:
                        staged = torch.empty((len(ins), *dev.shape[1:]), dtype=dev.dtype, device=dev.device)
                        for first, row, n in in_runs:
                            staged[row:row + n].copy_(host[first:first + n], non_blocking=asynchronous)
                        dev.index_copy_(0, in_rows, staged)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)

    def _staging_plan(self, device_blocks: list[int], host_blocks: list[int], stream):
        """(the device blocks as an index tensor, in staging-row order; (first host block, first staging row,
        count) per run of consecutive host blocks). The index goes up without a host wait (pinned, h2d)."""
        if not device_blocks:
            return None, []
        rows = h2d(device_blocks, self.device, torch.int64)
        if stream is not None:
            rows.record_stream(stream)
        return rows, host_runs(host_blocks)

    def sleep(self) -> int:
        """Free the KV cache (a colocated trainer takes its memory, brrr/train/rollout.py) and the captured graphs
        (they hold the cache's addresses, and their memory pool); the bytes of cache freed. One process only."""
        freed = sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)
        self.drop_graphs()
        self.kv_caches = []
        return freed

    def wake(self) -> None:
        """The KV cache back, as allocated at start (its contents and fp8 scales are gone: the caller drops its
        prefix cache), and the graphs captured again over it when there were any: the trainer's weights were
        updated in place, so the same addresses hold the new values."""
        self.kv_caches = self._new_kv_caches()
        if self.captured is not None:
            self.capture_cuda_graphs(*self.captured)

    def copy_here(self, copies: np.ndarray) -> None:
        src, dst = h2d(copies, self.device)
        for k, v in self.kv_caches:
            for cache in (as_bytes(k), as_bytes(v)):  # (fp8 as bytes: CPU indexing has no fp8 kernels)
                cache[dst] = cache[src]

    @torch.inference_mode()
    def run_step(self, record: StepRecord, source=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage a step and run it: (logits of its read rows, hidden states where kept). source (rank 0 only): a
        decode step's (device tokens, rows) its ids are gathered from, or the device drafts an eager or verify
        step's ids are completed with. Nothing here waits for the device."""
        if record.copies is not None:
            self.copy_here(record.copies)
        for update in record.row_updates:
            self.row_input.apply(update)
        if record.kind == "decode":
            return self._run_decode(record, source), None
        if record.kind == "verify":
            return self.verify_graphs.run(record, source)
        return self._run_eager(record, source)

    def _share_ids(self, record: StepRecord, ids: torch.Tensor) -> None:
        """Ids rank 0 gathered on its device, on every rank (the workers staged zeros there)."""
        if record.device_ids and self.comm is not None:
            self.comm.broadcast(ids, src=0)

    def stage_rows(self, record: StepRecord) -> None:
        """The step's per-row values into the row input's buffer (a graph input)."""
        if self.row_input is not None:
            n = len(record.row_values)
            self.row_input.buffer[:n].copy_(h2d(record.row_values, self.device))

    def _run_decode(self, record: StepRecord, ids_from) -> torch.Tensor:
        (host,) = record.arrays
        g = record.size
        stage_decode_inputs(h2d(host, self.device), g, record.rows, record.width, self.g_ids, self.g_pos, self.g_slots,
                            self.g_ctx, self.g_tables, ids_from)
        self._share_ids(record, self.g_ids[:g])
        self.stage_rows(record)
        graph, logits, _ = self.graph_for(g, record.longest)
        graph.replay()
        self.decode_replays += 1
        return logits[:record.rows]

    def _run_eager(self, record: StepRecord, drafts) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions, slots, cu, context, tables, rows, *draft_index = stage(self.device, *record.arrays)
        if drafts is not None:  # drafts still on the device: their ids gathered there
            write_device_drafts(ids, drafts, *draft_index)
        self._share_ids(record, ids)
        meta = AttnMeta(cu_seqlens_q=cu, seqlens_q=record.seqlens, context_lens=record.context_lens,
                        slot_mapping=slots, block_tables=tables, kv_caches=self.kv_caches, context_lens_t=context)
        if record.observe:
            meta.observe = self.attention_observer.observer(record.observe, tables, self.kv_caches)
        if self.row_input is not None:
            self.stage_rows(record)
            self.row_input.begin(len(ids))
        hidden = self.model(ids, positions, meta)
        if self.row_input is not None:
            self.row_input.end()
        return self.model.compute_logits(hidden.index_select(0, rows)), hidden

    # ---- host staging (rank 0) -------------------------------------------------------------------------------
    def graph_for(self, size: int, longest: int) -> tuple:
        """(graph, logits, meta) a step of `size` (a captured size) replays: the one planned for the tightest
        context bound its longest context fits."""
        return self.graphs[size][graph_plan_for(tuple(self.graphs[size]), longest)]

    def _replay(self, batch: ScheduledBatch, ids_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, vocab] for a decode-only step, through the captured graph for the next size up. ids_from:
        (device tokens, device row index): the input ids are those tokens, gathered on the device (a step launched
        before the host has read the previous step's tokens). Nothing here waits for the GPU."""
        ahead = ids_from is not None
        g, b, width, host, longest = self.decode_inputs(batch, ahead=ahead)
        record = StepRecord("decode", (host,), size=g, rows=b, width=width, longest=longest, device_ids=ahead,
                            **self.row_fields(batch, [1] * b, g))
        return self._run(record, ids_from)[0]

    def decode_inputs(self, batch: ScheduledBatch, ahead: bool = False) -> tuple[int, int, int, np.ndarray, int]:
        """A decode step's graph inputs as one host array, staged by one copy and one kernel: (captured size g, rows
        b, block-table width, [ids, positions, slots, context lengths (g each), then the b x width tables], longest
        context). ahead: launched before the host has read the previous step's tokens, so each sequence is one token
        further than recorded and its id (0 here) is gathered on the device."""
        b = len(batch.items)
        g = next(size for size in sorted(self.graphs) if size >= b)
        ids, positions, slots, _, context_lens, tables = self._flatten(batch, ahead=ahead)
        host = np.zeros((4, g), dtype=np.int64)
        host[0, :b] = 0 if ahead else ids
        host[1:, :b] = positions, slots, context_lens
        # padded rows b..g: token 0 at position 0, writing to the spare block, reading 1 token
        host[2, b:], host[3, b:] = self.num_blocks * self.block_size, 1
        return g, b, tables.shape[1], np.concatenate([host.ravel(), tables.ravel()]), max(context_lens)

    def row_fields(self, batch: ScheduledBatch, counts: list[int], num_rows: int) -> dict:
        """A record's row input fields: each item's value (batch.row_values, the plan's; None: no feature set
        them) on each of its `counts` rows, -1 on the rest of the num_rows, and the input's updates since the last
        step (a sharded runner's travel with the record to every rank)."""
        if self.row_input is None:
            return {}
        size = self.row_input.buffer.shape[0]
        if num_rows > size:
            raise BrrrError(f"a step of {num_rows} rows exceeds the row input buffer ({size}: max_num_batched_tokens)")
        rows = np.full(num_rows, -1, dtype=np.int32)
        if batch.row_values is not None:
            counts = np.asarray(counts, dtype=np.int64)
            rows[:int(counts.sum())] = np.repeat(batch.row_values, counts)
        return {"row_values": rows, "row_updates": self.row_input.take_updates()}

    def _flatten(self, batch: ScheduledBatch, ahead: bool = False):
        """The step as flat arrays: token ids, positions and cache slots of every new token (numpy, not a Python
        loop per token: prefill steps carry thousands), query lengths, context lengths, padded block tables."""
        bs = self.block_size
        ids, seqlens, context_lens = [], [], []
        width = max(len(seq.block_table) for seq, _ in batch.items)
        tables = np.zeros((len(batch.items), width), dtype=np.int32)
        for i, (seq, n) in enumerate(batch.items):
            start = seq.num_computed_tokens + ahead
            if not ahead:
                chunk = seq.token_ids[start:start + n]
                if len(chunk) < n:  # a speculating decode: its draft tokens follow its last token
                    chunk += seq.spec_tokens[:n - len(chunk)]
                ids += chunk
            seqlens.append(n)
            # the kept tokens (eviction.py, snapkv.py)
            context_lens.append(start + n - seq.num_evicted_blocks * bs - seq.num_dropped_tokens)
            tables[i, : len(seq.block_table)] = seq.block_table
        starts = np.repeat(np.array([seq.num_computed_tokens + ahead for seq, _ in batch.items]), seqlens)
        rows = np.repeat(np.arange(len(seqlens)), seqlens)
        positions = starts + np.arange(sum(seqlens)) - np.repeat(np.cumsum(seqlens) - seqlens, seqlens)
        # an evicting sequence's new tokens lie past what it dropped: position p is cache row p - dropped (whole
        # blocks for streaming: logical block j is table entry j - evicted)
        dropped = np.repeat(np.array([seq.num_evicted_blocks * bs + seq.num_dropped_tokens for seq, _ in batch.items]),
                            seqlens)
        rows_at = positions - dropped
        slots = tables[rows, rows_at // bs].astype(np.int64) * bs + rows_at % bs
        return ids, positions.astype(np.int64), slots, seqlens, context_lens, tables

    def _eager_record(self, batch: ScheduledBatch, rows: list[int], logit_rows) -> tuple[StepRecord, object]:
        """(the record of a step run eagerly, the device drafts its ids are completed with or None)."""
        ids, positions, slots, seqlens, context_lens, tables = self._flatten(batch)
        cu = np.zeros(len(seqlens) + 1, dtype=np.int32)
        np.cumsum(seqlens, out=cu[1:])
        gather = device_draft_gather(batch)
        arrays = (np.array(ids, dtype=np.int64), positions, slots, cu, np.array(context_lens, dtype=np.int32),
                  pad_tables(tables), np.array(rows + list(logit_rows), dtype=np.int64),
                  *(gather[1:] if gather else ()))
        record = StepRecord("eager", arrays, block_copies(batch.copies), seqlens=seqlens, context_lens=context_lens,
                            rows=len(rows), device_ids=gather is not None,
                            observe=[] if self.attention_observer is None
                            else self.attention_observer.observe_items(batch, cu),
                            **self.row_fields(batch, seqlens, len(ids)))
        return record, None if gather is None else gather[0]

    # ---- what the engine calls (rank 0) ------------------------------------------------------------------------
    def can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether `launch` takes this batch: decode-only, no block copies, within the captured sizes."""
        return (bool(self.graphs) and not batch.copies and len(batch.items) <= max(self.graphs)
                and all(n == 1 for _, n in batch.items))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, rows: list[SampleRow],
               ids_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> PendingTokens:
        """Queue a decode step and its sampling (rows without logprobs) on the GPU and return without waiting."""
        return self.launch_sampling(self._replay(batch, ids_from), rows)

    @torch.inference_mode()
    def launch_graphed(self, batch: ScheduledBatch, sample_rows: list[tuple[int, SampleRow]]) -> torch.Tensor | None:
        """Queue a step through a decode or verify graph and its sampling (rows without logprobs): its tokens on
        the device, nothing waited for; None when no graph takes it. sample_rows as `execute`'s."""
        where, rows = [r for r, _ in sample_rows], [row for _, row in sample_rows]
        if self.can_launch(batch) and where == list(range(len(batch.items))):
            return draw(self._replay(batch), rows)[0]
        verify = self.verify_graphs
        if verify is None or batch.copies or not verify.takes(batch):
            return None
        return draw(verify.replay(batch, where, False)[0], rows)[0]

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch,
                       ids_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Queue a decode step's forward alone: its logits [B, vocab], to sample with `launch_sampling` once the host
        knows how (a grammar's mask needs the previous token)."""
        return self._replay(batch, ids_from)

    @staticmethod
    @torch.inference_mode()
    def launch_sampling(logits: torch.Tensor, rows: list[SampleRow], bitmask=None) -> PendingTokens:
        return PendingTokens(draw(logits, rows, bitmask)[0])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[tuple[int, SampleRow]], logit_rows: list[int] = (),
                want_hidden: bool = False) -> tuple[SampleResult, torch.Tensor | None, torch.Tensor | None]:
        """Run one step. sample_rows: (row of the flattened batch, how to sample it); logit_rows: extra rows whose
        log-probabilities the caller wants (prompt_logprobs). Returns the samples, those log-probs, and with
        want_hidden the model's output [tokens, hidden] for every row (an EAGLE proposer reads it; decode graphs
        keep only logits, verify graphs keep it when captured for it; under tensor parallelism rank 0's, which the
        all-reduces made every rank's). A step of decodes replays a decode graph; one whose rows have up to q tokens
        (verify steps, a draft model's catch-up) a verify graph; the rest, and steps that want prompt log-probs,
        run eagerly."""
        rows, sampling = [r for r, _ in sample_rows], [row for _, row in sample_rows]
        if not logit_rows and not want_hidden and self.can_launch(batch):
            logits = self._replay(batch)
            if rows != list(range(len(batch.items))):  # a decode step samples every row, in order: no copy then
                logits = logits.index_select(0, h2d(rows, self.device, torch.long))
            return sample(logits, sampling), None, None
        verify = self.verify_graphs
        # (a step of decodes that missed the decode graphs, block copies say, stays eager: q times its tokens)
        if (verify is not None and not logit_rows and (verify.hidden or not want_hidden) and verify.takes(batch)
                and (want_hidden or any(n > 1 for _, n in batch.items))):
            logits, hidden = verify.replay(batch, rows, want_hidden)
            return sample(logits, sampling), None, hidden
        record, drafts = self._eager_record(batch, rows, logit_rows)
        logits, hidden = self._run(record, drafts)
        result = sample(logits[: len(rows)], sampling)
        extra = logits[len(rows):].log_softmax(-1) if logit_rows else None
        return result, extra, hidden if want_hidden else None

    # ---- tensor parallelism (rank 0 of a sharded model) ------------------------------------------------------
    def _group(self, what: str):
        if self.tp is None:
            raise BrrrError(f"{what} measures a tensor-parallel engine's all-reduce: tensor_parallel_size is 1")
        return self.tp

    def choose_all_reduce(self, max_graph_batch: int, iters: int = 200) -> int:
        """Set up the one-shot all-reduce on every rank and route to it the decode messages up to the largest size
        at which it beat NCCL in CUDA graphs (`tp_group.RankZero.choose_all_reduce`). Returns that bound in bytes."""
        return self._group("choose_all_reduce").choose_all_reduce(self, max_graph_batch, iters)

    def time_all_reduce(self, rows: int, iters: int = 200) -> dict:
        """The all-reduce of a decode step of `rows` rows inside a CUDA graph (`tp_group.RankZero.time_all_reduce`)."""
        return self._group("time_all_reduce").time_all_reduce(self, rows, iters)

    def shard_shapes(self) -> list[dict[str, tuple[tuple[int, ...], int]]]:
        """Each rank's parameters: {name: (shape, bytes)}, rank 0 first."""
        if self.tp is None:
            return [{n: (tuple(p.shape), p.nbytes) for n, p in self.model.named_parameters()}]
        return self.tp.shard_shapes(self)

    def shutdown(self) -> None:
        """Stop a sharded model's workers (their graphs and the group's first); nothing to do on one device."""
        if self.tp is not None:
            self.tp.shutdown(self)

    @staticmethod
    @torch.inference_mode()
    def profile_num_blocks(model, block_size: int, max_num_batched_tokens: int, gpu_memory_utilization: float,
                           extra_bytes_per_block: int = 0, kv_cache_dtype: str = "auto") -> int:
        """CUDA: run one forward at the full token budget, then give the KV cache what `kv_cache_bytes` allows.
        extra_bytes_per_block: what else each block of tokens costs (a draft model's own KV cache)."""
        device = next(model.parameters()).device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        n = max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=device)
        model.compute_logits(model(ids, torch.arange(n, device=device), AttnMeta.causal([n], device))[-256:])
        torch.cuda.synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        in_use = torch.cuda.memory_reserved(device)
        per_block = kv_bytes_per_block(model.config, block_size, cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
                                       ) + extra_bytes_per_block
        return max(0, kv_cache_bytes(free, total, in_use, activations, gpu_memory_utilization) // per_block)
