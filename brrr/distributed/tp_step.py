"""One step of a tensor-parallel engine as every rank runs it: rank 0 (tp_runner.py) builds it from the scheduled
batch and sends it; the workers (tp_worker.py) receive it; both run it over their own shard and KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brrr.engine.model_runner import ModelRunner
from brrr.engine.sampler import h2d
from brrr.engine.staging import stage
from brrr.kernels import AttnMeta
from brrr.kernels.graph_inputs import stage_decode_inputs


@dataclass
class StepInputs:
    """One step as every rank runs it: block copies, then the flattened batch, then the rows whose logits to read."""
    copies: list
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seqlens: list[int]
    context_lens: list[int]
    tables: np.ndarray
    rows: np.ndarray


@dataclass
class GraphInputs:
    """A decode step replayed through the captured graph of `size` rows (`rows` of them real), as every rank
    replays it: the static buffers' contents in `ModelRunner.decode_inputs`' layout, and the longest context (which of
    the size's graphs)."""
    size: int
    rows: int
    width: int
    host: np.ndarray
    longest: int
    ahead: bool = False  # launched before the host read the previous step: the ids are on rank 0's GPU only


def replay_step(runner: ModelRunner, step: GraphInputs, ids_from=None) -> torch.Tensor:
    """Logits [rows, vocab] of a captured decode step (every rank replays it: the collectives inside pair up).
    ids_from (rank 0, a step launched ahead): the device tokens and rows its ids are gathered from, as in
    `ModelRunner._replay`; rank 0 then broadcasts them to the workers, on the GPU, ahead of the graph."""
    stage_decode_inputs(h2d(step.host, runner.device), step.size, step.rows, step.width, runner.g_ids,
                        runner.g_pos, runner.g_slots, runner.g_ctx, runner.g_tables, ids_from)
    if step.ahead:
        runner.model.tp_comm.broadcast(runner.g_ids[: step.size], src=0)
    graph, logits, _ = runner.graph_for(step.size, step.longest)
    graph.replay()
    return logits[: step.rows]


def forward_step(runner: ModelRunner, step: StepInputs) -> torch.Tensor:
    """Logits of `step.rows` (every rank calls this with the same step: its collectives pair up)."""
    runner.copy_blocks(step.copies)
    cu = np.zeros(len(step.seqlens) + 1, dtype=np.int32)
    np.cumsum(step.seqlens, out=cu[1:])
    ids, positions, slots, cu_t, context, tables, rows = stage(
        runner.device, step.ids, step.positions, step.slots, cu, np.array(step.context_lens, dtype=np.int32),
        step.tables, step.rows)
    meta = AttnMeta(cu_seqlens_q=cu_t, seqlens_q=step.seqlens, context_lens=step.context_lens, slot_mapping=slots,
                    block_tables=tables, kv_caches=runner.kv_caches, context_lens_t=context)
    hidden = runner.model(ids, positions, meta)
    return runner.model.compute_logits(hidden.index_select(0, rows))


def time_all_reduce(runner: ModelRunner, rows: int, iters: int, backend: str = "nccl") -> float | None:
    """Microseconds per all-reduce of a decode step's activations [rows, hidden] through `backend` ("nccl" or
    "oneshot"), measured as the decode graphs run them: `iters` of them captured back to back in one CUDA graph on
    every rank (every rank calls this together). None where the one-shot path cannot take the message (the same
    answer on every rank: it depends on the shape and dtype only)."""
    comm, model = runner.model.tp_comm, runner.model
    x = torch.zeros(rows, model.full_config.hidden_size, dtype=runner.dtype, device=runner.device)
    if backend == "oneshot":
        if comm.oneshot is None or not comm.oneshot.supports(x):
            return None
        reduce = comm.oneshot
        try:
            reduce(x)  # the op's own checks run on the host before its kernel, alike on every rank
        except (RuntimeError, AttributeError):
            return None
    else:
        reduce = comm.nccl_all_reduce
    for _ in range(3):  # NCCL sets up its buffers for this size outside the capture
        reduce(x)
    torch.cuda.synchronize(runner.device)
    graph = torch.cuda.CUDAGraph()
    # as the runner's captures (model_runner._cuda_capture): a stream of this device, and thread_local so that the
    # watchdog thread's event query during the capture does not invalidate it (in the global mode it does)
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(runner.device), capture_error_mode="thread_local"):
        for _ in range(iters):
            reduce(x)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def message_bytes(runner: ModelRunner, rows: int) -> int:
    """Bytes of a decode step's all-reduce message of `rows` rows: [rows, hidden] in the model's dtype."""
    return rows * runner.model.full_config.hidden_size * runner.dtype.itemsize
