"""The decode side's handle on its prefill instances (disagg_prefill.py): starting them, their pipes and KV
channels, each one's receiver thread, liveness, and stopping them.

Each instance is a spawned process; it and the decode instance meet in a two-rank process group of their own
(FileStore rendezvous, as the tensor-parallel workers do). A pull is two things in order: ("pull", id) down the
pipe, and a receive queued on this instance's receiver thread, which posts them in the order the pulls were sent,
the order the instance's reader thread sends them in. The receiver hands each finished transfer (or its error) to
the engine's thread through `done`.
"""
from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp

from brrr.distributed.disagg_prefill import InstanceSpec, prefill_main
from brrr.distributed.tp_worker import START_TIMEOUT_S, connect, stop_processes
from brrr.errors import BrrrError


class PrefillInstance:
    def __init__(self, index: int, device: torch.device, spec: InstanceSpec, ctx, workdir: str):
        self.index, self.device = index, device
        self.store_path = os.path.join(workdir, f"store{index}")
        ours, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, name=f"brrr-prefill{index}", daemon=True,
                                args=(spec, self.store_path, theirs))
        self.proc.start()
        theirs.close()
        self.conn = ours
        self.group = None
        self.layout: dict = {}
        self.lost: str | None = None  # why this instance is out of service
        # (request_id, shape, dtype, when pulled) to receive, in pull order
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        # (request_id, buffer or None, seconds from the pull, error or None)
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.outstanding = 0  # requests sent here and not yet answered or pulled (the router's load measure)
        self.prefilling = 0  # of those, the ones not answered yet
        self.heard = 0.0  # time.monotonic() of its last message, or of when it last became busy

    @property
    def name(self) -> str:
        return f"prefill instance {self.index} ({self.device}, pid {self.proc.pid})"

    @property
    def num_blocks(self) -> int:
        return self.layout["num_blocks"]

    def exit_reason(self) -> str | None:
        """Why the process is gone (with its last error line, if it sent one), or None while it runs."""
        if self.proc.exitcode is None:
            return None
        last = ""
        try:
            while self.conn.poll(0):
                message = self.conn.recv()
                if message[0] == "error":
                    last = f" ({message[1].strip().splitlines()[-1]})"
        except (EOFError, OSError):
            pass
        return f"{self.name} exited with code {self.proc.exitcode}{last}"

    def send(self, message) -> None:
        self.conn.send(message)

    def pull(self, request_id: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        pulled = time.perf_counter()
        self.conn.send(("pull", request_id))
        self.jobs.put((request_id, shape, dtype, pulled))

    def start_receiving(self, decode_device: torch.device) -> None:
        threading.Thread(target=self._receive, args=(decode_device,), name=f"brrr-kv-from-prefill{self.index}",
                         daemon=True).start()

    def _receive(self, device: torch.device) -> None:
        from brrr.distributed.disagg_transfer import receive_kv, transfer_stream

        broken = None
        with transfer_stream(device):
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                request_id, shape, dtype, pulled = job
                if broken is None:
                    try:
                        buf = receive_kv(self.group, shape, dtype, device)
                        self.done.put((request_id, buf, time.perf_counter() - pulled, None))
                        continue
                    except Exception as e:  # noqa: BLE001 - a broken channel: every later pull fails too
                        broken = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
                self.done.put((request_id, None, time.perf_counter() - pulled, broken))

    def stop_receiving(self) -> None:
        self.jobs.put(None)


class PrefillInstances:
    """Every prefill instance of one decode instance, started together (they load while the decode side loads)."""

    def __init__(self, ids: tuple[int, ...], model: str, dtype: str, device: torch.device, config):
        import dataclasses

        from brrr.config.disaggregation import instance_device

        self._dir = tempfile.TemporaryDirectory(prefix="brrr-disagg-")
        ctx = mp.get_context("spawn")
        # the prefill instances' engines: no decode graphs (they decode nothing), no disaggregation of their own
        config = dataclasses.replace(config, disaggregate=None, cuda_graphs=False)
        threads = max(1, torch.get_num_threads() // (len(ids) + 1))
        self.instances = []
        for index, gpu in enumerate(ids):
            where = instance_device(device, gpu)
            spec = InstanceSpec(model, dtype, str(where), config, threads)
            self.instances.append(PrefillInstance(index, where, spec, ctx, self._dir.name))
        self._finalizer = weakref.finalize(self, _stop, self.instances)

    def __iter__(self):
        return iter(self.instances)

    def alive(self) -> list[PrefillInstance]:
        return [i for i in self.instances if i.lost is None]

    def connect(self, decode_device: torch.device) -> None:
        """Join every instance's channel (rank 0 of each), watching the processes while the rendezvous waits, then
        wait for each to be loaded ("ready", with its cache layout)."""
        for inst in self.instances:
            done: dict = {}

            def join(inst=inst, done=done):
                try:
                    done["group"] = connect(inst.store_path, 0, 2, decode_device).group
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    done["error"] = e

            thread = threading.Thread(target=join, name="brrr-disagg-rendezvous", daemon=True)
            with _nccl_errors_left_to_us():
                thread.start()
                while thread.is_alive():
                    thread.join(0.5)
                    self._check_started(inst)
            if "error" in done:
                raise done["error"]
            inst.group = done["group"]
        for inst in self.instances:
            waited = 0.0
            while not inst.conn.poll(0.5):
                waited += 0.5
                self._check_started(inst)
                if waited > START_TIMEOUT_S:
                    raise BrrrError(f"{inst.name} did not load within {START_TIMEOUT_S:.0f} s")
            kind, payload = inst.conn.recv()
            if kind != "ready":
                raise BrrrError(f"{inst.name} failed to start:\n{payload}")
            inst.layout = payload
            inst.start_receiving(decode_device)

    @staticmethod
    def _check_started(inst: PrefillInstance) -> None:
        why = inst.exit_reason()
        if why is not None:
            raise BrrrError(f"{why} while starting")

    def check_layout(self, kv_caches, block_size: int) -> None:
        """Every instance's blocks have the decode instance's shape and dtype (the same model and block size)."""
        k = kv_caches[0][0]
        want = {"block_size": block_size, "dtype": k.dtype, "block_shape": tuple(k.shape[1:]),
                "num_layers": len(kv_caches)}
        for inst in self.instances:
            got = {key: inst.layout[key] for key in want}
            if got != want:
                raise BrrrError(f"{inst.name}: its KV blocks are {got}, the decode instance's {want}")

    def shutdown(self) -> None:
        """Stop and join every instance (terminated if it does not stop within a few seconds)."""
        self._finalizer()


@contextlib.contextmanager
def _nccl_errors_left_to_us():
    """torch's NCCL watchdog, by default, ends the whole process when an operation of the group fails or times
    out: the decode instance must outlive a prefill instance, so its channels are made without that (their failures
    are handled here: timeouts on receives, the channel aborted when its instance goes). The setting is read when a
    group is made; the environment is restored after."""
    key, before = "TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def _stop(instances: list[PrefillInstance]) -> None:
    for inst in instances:
        inst.stop_receiving()
    stop_processes([i.proc for i in instances], [i.conn for i in instances])
