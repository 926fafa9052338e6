"""Rank 0's side of a tensor-parallel ModelRunner: `RankZero`, attached to rank 0's shard as `model.tp_group`.

Every rank runs the same `ModelRunner` (brrr/engine/model_runner.py) over its own shard and KV cache. The runner on
rank 0 stages each step from the scheduled batch into a `StepRecord` and hands it here: `step` sends it to every
worker (one pickled host message each), then runs it on rank 0; the workers (tp_worker.py) run the same
`ModelRunner.run_step` on it, and the collectives inside pair up. Other runner calls go the same way (`call`:
capture the graphs, copy blocks, drop the graphs; `gather`: with each worker's answer). Only rank 0 samples.

Here too, the start-up choice of the decode all-reduce (oneshot.py): set up the one-shot path on every rank, time it
against NCCL inside CUDA graphs at the decode messages' sizes, and route every rank's messages the same way.
"""
from __future__ import annotations

import logging

import torch

from brrr.distributed.oneshot import LaunchWatchdog, choose_bound, rendezvous_begun, timed_rows
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")
# Longest a collective may wait for its peers before the rank gives up: a dead peer that gloo does not notice, or a
# hung one, ends in an error after this. Generous, since the first CUDA steps compile kernels on every rank. The
# one-shot path's watchdog (oneshot.LaunchWatchdog) waits as long.
COLLECTIVE_TIMEOUT_S = 120.0


def setup_oneshot(runner, capacity: int) -> str | None:
    """Collective: map the one-shot buffers on every rank; why it failed here, or None."""
    return runner.model.tp_comm.setup_oneshot(runner.device, capacity)


def set_oneshot_bound(runner, bound: int) -> None:
    """Rank 0's choice, set on every rank: the graphs pair up only if every rank routes a message the same way."""
    runner.model.tp_comm.set_oneshot_bound(bound)


def own_shapes(runner) -> dict[str, tuple[tuple[int, ...], int]]:
    return {n: (tuple(p.shape), p.nbytes) for n, p in runner.model.named_parameters()}


def time_all_reduce(runner, rows: int, iters: int, backend: str = "nccl") -> float | None:
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


def message_bytes(runner, rows: int) -> int:
    """Bytes of a decode step's all-reduce message of `rows` rows: [rows, hidden] in the model's dtype."""
    return rows * runner.model.full_config.hidden_size * runner.dtype.itemsize


# What a worker may be asked to run beside the ModelRunner's own methods: name -> f(runner, *args)
FUNCTIONS = {f.__name__: f for f in (setup_oneshot, set_oneshot_bound, own_shapes, time_all_reduce)}


def resolve(runner, name: str):
    """The callable a call of `name` runs on a rank: one of FUNCTIONS (bound to the runner) or a runner method."""
    fn = FUNCTIONS.get(name)
    return (lambda *args: fn(runner, *args)) if fn is not None else getattr(runner, name)


class RankZero:
    def __init__(self, workers):
        """workers: the tp_worker.WorkerGroup of ranks 1..N-1."""
        self.workers, self.watchdog = workers, None

    @property
    def down(self) -> str | None:
        """Why the group is down (a worker died or a collective failed), or None."""
        return self.workers.down

    def start(self, spec: dict) -> None:
        """Every worker builds its ModelRunner like rank 0's (spec: its arguments; tp_worker.build_runner)."""
        self.workers.send_all(("runner", spec))

    def call(self, runner, name: str, *args):
        """runner.name(*args) on every worker, then here; rank 0's result."""
        self.workers.send_all(("call", (name, args, False)))
        return self._local(resolve(runner, name), *args)

    def gather(self, runner, name: str, *args, timeout_s: float = 60.0) -> list:
        """As `call`, with every rank's result, rank 0 first."""
        self.workers.send_all(("call", (name, args, True)))
        mine = self._local(resolve(runner, name), *args)
        return [mine] + [self.workers.receive(rank, name, timeout_s) for rank in range(1, self.workers.world)]

    def step(self, runner, record, source):
        """One step on every rank: the record to the workers, then run here (source: rank 0's device inputs)."""
        self.workers.send_all(("call", ("run_step", (record,), False)))
        if self.watchdog is None:
            return self._local(runner.run_step, record, source)
        self.watchdog.begin()
        try:
            return self._local(runner.run_step, record, source)
        finally:  # a step that failed is watched too: what it launched may still wait on a dead peer
            self.watchdog.mark()

    def _local(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # a collective broke: a peer died or timed out
            self.workers.fail(f"a tensor-parallel collective failed ({type(e).__name__}: {e})")
            raise BrrrError(self.workers.down) from None

    def choose_all_reduce(self, runner, max_graph_batch: int, iters: int = 200) -> int:
        """Set up the one-shot all-reduce on every rank and time it against NCCL at the decode messages' sizes
        (`timed_rows`), inside CUDA graphs; route to it the messages up to the largest size at which it won
        (`choose_bound`). Returns that bound in bytes, 0 where NCCL takes everything; logs the choice in one line.
        Collective: every rank sets the bound rank 0 decided."""
        rows = timed_rows(max_graph_batch)
        capacity = -(-message_bytes(runner, rows[-1]) // 16) * 16
        if rendezvous_begun():  # the workers are new processes; this one has met its peers before (oneshot.py)
            failed = [(0, "this process set up symmetric memory for an earlier engine, and this torch counts "
                          "rendezvous per process, not per group (pytorch/pytorch#196082): one engine per process")]
        else:
            errors = self.gather(runner, "setup_oneshot", capacity, timeout_s=600)
            failed = [(rank, e) for rank, e in enumerate(errors) if e]
        timings, bound = [], 0
        if failed:
            rank, why = failed[0]
            log.warning("tensor-parallel all-reduce: NCCL for every message (the one-shot all-reduce could not be "
                        "set up on rank %d: %s)", rank, why)
        else:
            for r in rows:
                timings.append((message_bytes(runner, r), self._timed(runner, r, iters, "nccl"),
                                self._timed(runner, r, iters, "oneshot")))
            bound = choose_bound(timings)
            log.info("tensor-parallel all-reduce: one-shot up to %d bytes, NCCL above (us per all-reduce in a CUDA "
                     "graph, bytes: NCCL / one-shot: %s)", bound,
                     ", ".join(f"{b}: {n:.1f} / {'-' if o is None else f'{o:.1f}'}" for b, n, o in timings))
        self.call(runner, "set_oneshot_bound", bound)
        if bound and self.watchdog is None:
            self.watchdog = LaunchWatchdog(self.workers.procs, COLLECTIVE_TIMEOUT_S).start()
        return bound

    def time_all_reduce(self, runner, rows: int, iters: int = 200) -> dict:
        """The all-reduce of a decode step of `rows` rows inside a CUDA graph (rank 0's clock; CUDA only):
        microseconds per all-reduce through NCCL and through the one-shot path (None where it is not set up or
        cannot take the message), which of them the engine's graphs run, and the largest message the one-shot path
        takes (bytes; 0: none)."""
        x = torch.empty(rows, runner.model.full_config.hidden_size, dtype=runner.dtype, device=runner.device)
        comm = runner.model.tp_comm
        return {"all_reduce_us_nccl": self._timed(runner, rows, iters, "nccl"),
                "all_reduce_us_oneshot": self._timed(runner, rows, iters, "oneshot"),
                "all_reduce_backend": "oneshot" if comm.routes_to_oneshot(x) else "nccl",
                "all_reduce_oneshot_max_bytes": comm.oneshot_bound}

    def _timed(self, runner, rows: int, iters: int, backend: str) -> float | None:
        return self.gather(runner, "time_all_reduce", rows, iters, backend)[0]

    def shard_shapes(self, runner) -> list[dict[str, tuple[tuple[int, ...], int]]]:
        """Each rank's parameters: {name: (shape, bytes)}, rank 0 first."""
        return self.gather(runner, "own_shapes")

    def shutdown(self, runner) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        runner.drop_graphs()  # before the group (a worker drops its own on "stop")
        self.workers.shutdown()
