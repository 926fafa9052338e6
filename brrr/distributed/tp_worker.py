"""Tensor-parallel worker processes: ranks 1..N-1 of a serving engine whose rank 0 is the engine itself.

brrr starts them (torch.multiprocessing, spawn). Each joins the group's collectives (gloo on CPU, NCCL on CUDA),
loads its own shard, builds the same `ModelRunner` as rank 0 (its KV cache, its row input, its verify graphs), and
then runs the runner calls rank 0 sends over a pipe (tp_group.py): each step's `StepRecord` (a few arrays of ints)
as one host message per worker, the graph captures, the all-reduce set-up; every rank runs them in lockstep, and
only rank 0 samples. A worker that dies is seen by rank 0 before the
next step (its exit code) or inside a collective (gloo: the peer's socket closes; any backend: the collective
timeout), and the engine goes down with a BrrrError instead of waiting forever; a worker whose rank 0 is gone reads
EOF from its pipe and exits.
"""
from __future__ import annotations

import datetime
import os
import signal
import tempfile
import threading
import traceback
import weakref
from pathlib import Path

import torch
import torch.multiprocessing as mp

from brrr.config import EngineConfig
from brrr.distributed.shard_loader import load_shard
from brrr.distributed.sharding import Collectives, Partition
from brrr.distributed.tp_group import COLLECTIVE_TIMEOUT_S, resolve
from brrr.engine.model_runner import ModelRunner
from brrr.errors import BrrrError
from brrr.serving_form import prepare_for_serving

START_TIMEOUT_S = 600.0  # spawning, importing torch and loading a shard


def connect(store_path: str, rank: int, world: int, device: torch.device):
    """This rank's Collectives over a FileStore rendezvous (no port to pick or collide on)."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, timeout)
    # the same name on every rank, unique to this engine (its store's temporary directory)
    return Collectives(group, rank, world, store, os.path.basename(os.path.dirname(store_path)))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank, cuda:0 for rank 0 (or the device given) and the next ones after it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def worker_main(rank: int, world: int, store_path: str, cfg, path: str | None, files: list[str],
                dtype: torch.dtype, device: str, pack_projections: bool | None, conn) -> None:
    """path None: random weights of cfg's shape (benchmarks)."""
    serve_child(conn, _serve, rank, world, store_path, cfg, path and Path(path), [Path(f) for f in files], dtype,
                torch.device(device), pack_projections, conn)


def build_runner(model, spec: dict, pack_projections: bool | None):
    """A worker's ModelRunner, as rank 0 built its own (spec: `ModelRunner`'s arguments from rank 0). Graphs are
    captured when rank 0 says so, after the all-reduce choice: every rank's collectives in the same order."""
    row_input = None
    if spec["row_input"] is not None:  # rank 0's feature input (LoRA slots): this rank's model and its own input
        model, row_input = spec["row_input"](model, pack_projections)
    return ModelRunner(model, spec["block_size"], spec["num_blocks"], spec["max_model_len"], cuda_graphs=False,
                       max_graph_batch=spec["max_graph_batch"], row_input=row_input, verify=spec["verify"],
                       kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                       calculate_kv_scales=spec.get("calculate_kv_scales", False))


def serve_child(conn, serve, *args) -> None:
    """A child process's main: run serve(*args) until its parent says stop or is gone (EOF on the pipe); on any
    other error send the traceback up the pipe and exit 1. Ctrl-C reaches the whole process group, so the child
    ignores it: the parent decides when to stop (a server drains first), then says so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(*args)
    except EOFError:  # the parent is gone: nothing left to serve
        return
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)


def _serve(rank, world, store_path, cfg, path, files, dtype, device, pack_projections, conn) -> None:
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores: intra-op threads beyond a share only contend
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    comm = connect(store_path, rank, world, device)
    part = Partition(cfg, rank, world)
    model = load_shard(path, files, part, comm, dtype, device)
    model = prepare_for_serving(model, EngineConfig(pack_projections=pack_projections))
    conn.send(("ready", None))
    runner = None
    while True:
        kind, payload = conn.recv()
        if kind == "call":  # a runner call rank 0 makes on every rank (tp_group.RankZero)
            name, args, reply = payload
            out = resolve(runner, name)(*args)
            if reply:
                conn.send((name, out))
        elif kind == "stop":  # rank 0 closes its end of the group at the same time
            if runner is not None:
                runner.drop_graphs()  # before the group, as rank 0 does
            comm.close()
            return
        elif kind == "runner":
            runner = build_runner(model, payload, pack_projections)
        elif kind == "profile":  # the same forward rank 0 profiles with: its collectives need every rank
            conn.send(("blocks", ModelRunner.profile_num_blocks(model, *payload)))
        elif kind == "vocab":  # rank 0 keeps the whole vocabulary (tp_loader.DraftTarget); collective
            gather_vocabulary(model)


def gather_vocabulary(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: the whole embedding and LM head tables [vocab, hidden], assembled from every rank's rows (the
    same tensor when they are tied)."""
    with torch.no_grad():
        vocab, comm = model.full_config.vocab_size, model.tp_comm
        embed = comm.all_gather_rows(model.model.embed_tokens.weight)[:vocab]
        if model.lm_head.weight is model.model.embed_tokens.weight:
            return embed, embed
        return embed, comm.all_gather_rows(model.lm_head.weight)[:vocab]


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: their processes and pipes, liveness, shutdown."""

    def __init__(self, world: int, cfg, path: Path | None, files: list[Path], dtype: torch.dtype,
                 device: torch.device, pack_projections: bool | None):
        self.world, self.device, self.down = world, device, None
        self._dir = tempfile.TemporaryDirectory(prefix="brrr-tp-")
        self.store_path = os.path.join(self._dir.name, "store")
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"brrr-tp-rank{rank}", daemon=True,
                               args=(rank, world, self.store_path, cfg, path and str(path), [str(f) for f in files],
                                     dtype, str(device), pack_projections, theirs))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        # rank 0's Collectives once connected, and whether the group ends cleanly (every rank closing together)
        self._group = {"comm": None, "clean": True}
        self._finalizer = weakref.finalize(self, stop_processes, self.procs, self.conns, self._group)

    def wait_ready(self) -> None:
        for rank in range(1, self.world):
            self.receive(rank, "ready", START_TIMEOUT_S)

    def connect(self, device: torch.device):
        """Rank 0's Collectives. The rendezvous waits for every worker, so it runs in a thread while this one watches
        them: a worker that fails before joining is reported now, not after the store's timeout."""
        done: dict = {}

        def join():
            try:
                done["comm"] = connect(self.store_path, 0, self.world, device)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                done["error"] = e

        thread = threading.Thread(target=join, name="brrr-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
            self.check_alive()
        if "error" in done:
            raise done["error"]
        self._group["comm"] = done["comm"]
        return done["comm"]

    def check_alive(self) -> None:
        """BrrrError (and the group shut down) if any worker has exited; once down, always."""
        if self.down is None:
            for rank, proc in enumerate(self.procs, 1):
                if proc.exitcode is not None:
                    self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                    break
        if self.down is not None:
            raise BrrrError(self.down)

    def fail(self, reason: str) -> None:
        """Take the group down: every later step raises `reason` (with the first worker error that came back, if
        any); the other workers are stopped."""
        if self.down is None:
            self.down = f"{reason}{self._worker_error()}; the engine is down (restart it)"
            self._group["clean"] = False
            self.shutdown()

    def _worker_error(self) -> str:
        for rank, conn in enumerate(self.conns, 1):
            try:
                while conn.poll(0):
                    got, payload = conn.recv()
                    if got == "error":
                        return f" (rank {rank}: {payload.strip().splitlines()[-1]})"
            except (EOFError, OSError):
                continue
        return ""

    def send_all(self, message) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except OSError as e:
                self.fail(f"tensor-parallel worker rank {rank} is unreachable ({e})")
                raise BrrrError(self.down) from None

    def receive(self, rank: int, kind: str, timeout_s: float):
        """Worker `rank`'s reply of `kind`, polling its liveness; a worker's error comes back as a BrrrError."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        waited = 0.0
        while not conn.poll(0.5):
            waited += 0.5
            if proc.exitcode is not None or waited > timeout_s:
                what = (f"exited with code {proc.exitcode}" if proc.exitcode is not None
                        else f"sent nothing in {timeout_s:.0f} s")
                self.fail(f"tensor-parallel worker rank {rank} {what}")
                raise BrrrError(self.down)
        try:
            got, payload = conn.recv()
        except EOFError:
            self.fail(f"tensor-parallel worker rank {rank} closed its pipe")
            raise BrrrError(self.down) from None
        if got == "error":
            self.fail(f"tensor-parallel worker rank {rank} failed:\n{payload}")
            raise BrrrError(self.down)
        if got != kind:
            self.fail(f"tensor-parallel worker rank {rank} answered {got!r} where {kind!r} was due")
            raise BrrrError(self.down)
        return payload

    def shutdown(self) -> None:
        """Stop and join every worker (terminated if it does not stop within a few seconds)."""
        self._finalizer()


def stop_processes(procs, conns, group: dict | None = None) -> None:
    """Tell each process to stop, join it, terminate (then kill) one that does not stop within 5 s. group: this
    process's end of a process group shared with them ({"comm": Collectives, "clean": bool}), released here: left to
    process exit, NCCL's teardown of a group whose peers are gone can wait on them for minutes, so every rank closes
    it explicitly, together when stopping normally (a worker closes on "stop"), aborting it after a failure."""
    for conn in conns:
        try:
            conn.send(("stop", None))
        except OSError:
            pass
    if group is not None and group["comm"] is not None:
        closing = threading.Thread(target=group["comm"].close, args=(group["clean"],), daemon=True)
        closing.start()
        closing.join(30)  # a peer that never closes its end: give up waiting, exit anyway
        group["comm"] = None
    for proc in procs:
        proc.join(5)
        if proc.is_alive():  # blocked in a collective with a dead peer
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
