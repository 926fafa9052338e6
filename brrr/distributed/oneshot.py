"""One-shot all-reduce over peer-mapped buffers, for the small all-reduces of a tensor-parallel decode step.

Each rank holds one buffer that every other rank of the group has mapped over NVLink (PyTorch's symmetric memory,
its CUDA backend: P2P loads and per-block signal pads, no NVLink multicast). One kernel per all-reduce: each rank
copies its partial sums into its own buffer, the ranks meet on the signal pads, and each rank reads the N buffers
and adds them. A decode step's message is a few KiB, so its cost in NCCL is protocol latency, not bytes; here it is
one kernel and two barriers. For large messages NCCL's ring moves fewer bytes per rank, so `choose_bound` keeps the
one-shot path only up to the largest message size at which it was measured faster (tp_group.py measures both at
engine start, inside CUDA graphs as the decode graphs run them).

The symmetric-memory rendezvous finds its peers through a c10d ProcessGroup registered by name; brrr's group is a
bare NCCL backend (not torch.distributed's global group, so one process may hold several engines), so
`OneShotAllReduce.create` wraps that backend in a ProcessGroup under a name unique to the engine.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.distributed as dist

# the dtypes symm_mem's one-shot kernel is instantiated for
DTYPES = (torch.bfloat16, torch.float32)
# the kernel loads 16 bytes per thread where it can; a message of whole 16-byte vectors always can
ALIGN_BYTES = 16
# the message sizes (rows of the hidden size) timed at engine start: a batch-1 decode up to the largest graph
TIMED_ROWS = (1, 8, 32, 128, 512)
# Symmetric-memory rendezvous this process has begun. PyTorch keys a rendezvous's store entries by how many the
# process has done, not the group (pytorch/pytorch#196082): a second engine's workers are fresh processes that
# start at 0 while rank 0 has moved on, so they would wait on each other's keys forever.
_rendezvous_begun = 0


def rendezvous_begun() -> int:
    return _rendezvous_begun


class OneShotAllReduce:
    """Sum-all-reduce of a message of up to `capacity` bytes through this rank's symmetric buffer. Every rank calls
    it with the same shapes in the same order (as every collective): the signal pads pair the calls up."""

    def __init__(self, buffer: torch.Tensor, group_name: str, process_group):
        self.buffer, self.group_name, self.capacity = buffer, group_name, buffer.numel()
        self._process_group = process_group  # the registered wrapper: kept alive as long as the buffer

    @classmethod
    def create(cls, backend, store, rank: int, world: int, device: torch.device, capacity: int,
               name: str) -> "OneShotAllReduce":
        """Collective (every rank, together): register the group as `name`, allocate `capacity` bytes of symmetric
        memory and map every peer's. Raises where that cannot be done (no CUDA symmetric memory in this torch, no
        P2P between the GPUs); the caller falls back to NCCL."""
        import torch.distributed._symmetric_memory as symm_mem  # its import also registers the ops' Python side
        from torch._C._distributed_c10d import ProcessGroup, _register_process_group

        if device.type != "cuda":
            raise RuntimeError(f"symmetric memory needs CUDA devices, not {device.type}")
        if capacity <= 0 or capacity % ALIGN_BYTES:
            raise ValueError(f"one-shot buffer of {capacity} bytes: a positive multiple of {ALIGN_BYTES} is needed")
        for op in ("one_shot_all_reduce", "one_shot_all_reduce_copy_out"):
            if not hasattr(torch.ops.symm_mem, op):
                raise RuntimeError(f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{op}")
        # the rendezvous would otherwise try to set up an NVLink multicast object, which these machines lack
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        store = dist.PrefixStore(f"{name}/", store)
        group = ProcessGroup(store, rank, world)
        group._set_default_backend(ProcessGroup.BackendType.NCCL)
        group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, backend)
        group._set_group_name(name)
        _register_process_group(name, group)
        global _rendezvous_begun
        _rendezvous_begun += 1
        try:
            if not _deprecated(symm_mem.enable_symm_mem_for_group):
                # before torch 2.11 the rendezvous reads rank, size and store from a table filled here; later
                # versions read the registered group, and a filled table would only add store round trips
                torch._C._distributed_c10d._SymmetricMemory.set_group_info(name, rank, world, store)
            get_backend = getattr(symm_mem, "get_backend", None)  # absent before the NVSHMEM backend came
            if get_backend is not None and get_backend(device) not in (None, "CUDA"):
                symm_mem.set_backend("CUDA")  # P2P mappings; NVSHMEM's allocator is another library's setup
            buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, name)
        except BaseException:
            unregister(name)
            raise
        return cls(buffer, name, group)

    def supports(self, t: torch.Tensor) -> bool:
        """Whether `t` can go through the buffer. It depends only on the shape, dtype and layout, which are the
        same on every rank, so every rank routes a message the same way."""
        n = t.numel() * t.element_size()
        return (t.dtype in DTYPES and t.is_contiguous() and 0 < n <= self.capacity and n % ALIGN_BYTES == 0
                and t.device == self.buffer.device)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place. The kernel reads all of `t` into the buffer before the barrier
        that precedes its first write of the result, so the output may be `t` itself."""
        view, flat = self.buffer.view(t.dtype)[: t.numel()], t.view(-1)
        if (t.storage_offset() * t.element_size()) % ALIGN_BYTES:
            # the kernel moves 16-byte vectors in and out: an input that starts off that grid is copied into the
            # buffer here, and the sum comes back through an aligned tensor
            view.copy_(flat)
            flat.copy_(torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name))
        else:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, flat, "sum", self.group_name, flat)
        return t

    def close(self) -> None:
        self.buffer = None
        unregister(self.group_name)


def unregister(name: str) -> None:
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # never registered, or already gone
        pass


def _deprecated(fn) -> bool:
    return getattr(fn, "__deprecated__", None) is not None


def choose_bound(timings: list[tuple[int, float, float | None]]) -> int:
    """The largest message (bytes) to send through the one-shot path: the largest measured size up to which it was
    faster than NCCL at every measured size (0: never). timings: (bytes, NCCL us, one-shot us or None where it
    could not run). A size between two measured ones goes one-shot only if both neighbours did."""
    bound = 0
    for nbytes, nccl_us, oneshot_us in sorted(timings):
        if oneshot_us is None or oneshot_us >= nccl_us:
            break
        bound = nbytes
    return bound


def timed_rows(max_graph_batch: int) -> list[int]:
    """Row counts of the decode messages timed at engine start: the fixed ladder up to the largest graph batch,
    and that batch itself."""
    return sorted({r for r in TIMED_ROWS if r < max_graph_batch} | {max(1, max_graph_batch)})


class LaunchWatchdog:
    """Rank 0's guard for the one-shot all-reduce, whose kernel waits for its peers without a timeout (NCCL's
    watchdog does not see it): a worker that dies inside it leaves rank 0's GPU waiting for ever, and rank 0's host
    with it at its next read of a result. Once a worker has exited while rank 0 is launching a step (between `begin`
    and `mark`) or the last step it launched has not finished, for `stuck_after_s`, that step never will: `on_stuck`
    runs (by default this process exits, as NCCL's watchdog ends a rank whose collective timed out), instead of a
    hang. A dead worker with the GPU idle is left to the engine's own check before its next step."""

    def __init__(self, procs, stuck_after_s: float, on_stuck=None, poll_s: float = 1.0):
        self.procs, self.stuck_after_s, self.poll_s = procs, stuck_after_s, poll_s
        self.on_stuck = on_stuck or _exit_stuck
        self.launched = None  # the CUDA event recorded after the last launched step
        self.launching = False  # between begin() and mark(): the host may wait on the GPU inside a step's launch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="brrr-tp-watchdog", daemon=True)

    def start(self) -> "LaunchWatchdog":
        self._thread.start()
        return self

    def begin(self) -> None:
        """Called on the launching thread before each step is launched."""
        self.launching = True

    def mark(self) -> None:
        """Called on the launching thread after each step is launched: its end is what the watchdog waits for."""
        try:
            if self.launched is None:
                self.launched = torch.cuda.Event()
            self.launched.record()
        except RuntimeError:  # a broken CUDA context: the step's own error is the one to report
            pass
        self.launching = False

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        stuck_since = None
        while not self._stop.wait(self.poll_s):
            dead = next((rank for rank, p in enumerate(self.procs, 1) if p.exitcode is not None), None)
            # the event is queried only once a worker is gone: a CUDA call from this thread can break a capture
            # that another thread runs in the global mode
            waiting = dead is not None and (self.launching or (self.launched is not None and not self.launched.query()))
            if not waiting:
                stuck_since = None
                continue
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since >= self.stuck_after_s:
                self.on_stuck(f"tensor-parallel worker rank {dead} exited while rank 0's GPU waited on it in the "
                              f"one-shot all-reduce for {self.stuck_after_s:.0f} s; exiting (the engine is down)")
                return


def _exit_stuck(reason: str) -> None:
    logging.getLogger("brrr.engine").error(reason)
    os._exit(1)
