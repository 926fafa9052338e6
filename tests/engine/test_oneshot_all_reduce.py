"""The one-shot all-reduce's choice and routing, on CPU: which sizes it takes after the start-up measurement, which
messages `Collectives.all_reduce` sends to it, the fall back to the group's own all-reduce when it cannot be set
up, and the watchdog that ends rank 0 when a dead worker leaves its GPU waiting. Only the CUDA kernel itself is replaced (by `CpuOneShot`); the GPU test (tests/gpu/test_oneshot_all_reduce.py)
runs the real one."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from brrr.distributed.oneshot import LaunchWatchdog, OneShotAllReduce, choose_bound, timed_rows
from brrr.distributed.sharding import Collectives


@pytest.mark.parametrize("timings, bound", [
    ([(8192, 32.0, 9.0), (65536, 33.0, 12.0), (262144, 35.0, 30.0), (2097152, 60.0, 90.0)], 262144),
    ([(2097152, 60.0, 90.0), (8192, 32.0, 9.0)], 8192),  # order of the list does not matter
    ([(8192, 32.0, 40.0), (65536, 33.0, 12.0)], 0),  # lost at the smallest size: never, even where it won above
    ([(8192, 32.0, 32.0)], 0),  # a tie keeps NCCL
    ([(8192, 32.0, None), (65536, 33.0, 12.0)], 0),  # could not run the smallest message
    ([], 0),
])
def test_bound_is_the_largest_size_up_to_which_oneshot_always_won(timings, bound):
    assert choose_bound(timings) == bound


@pytest.mark.parametrize("max_graph_batch, rows", [
    (256, [1, 8, 32, 128, 256]), (8, [1, 8]), (1, [1]), (0, [1]), (1000, [1, 8, 32, 128, 512, 1000]),
])
def test_timed_rows_reach_the_largest_graph_batch(max_graph_batch, rows):
    assert timed_rows(max_graph_batch) == rows


class CpuOneShot(OneShotAllReduce):
    """The routing and the buffer as on CUDA; the kernel (CUDA only) replaced by a record of the call."""

    def __init__(self, capacity: int):
        super().__init__(torch.empty(capacity, dtype=torch.uint8), "cpu-oneshot", None)
        self.calls = []
        self.closed = False

    def __call__(self, t):
        self.calls.append((tuple(t.shape), t.dtype))
        return t

    def close(self):
        self.closed = True


@pytest.fixture
def comm(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))
    c = Collectives(group, 0, 1, store, "brrr-test-oneshot")
    yield c
    c.close()


def test_small_supported_messages_go_one_shot_and_the_rest_to_the_group(comm):
    fake = comm.oneshot = CpuOneShot(capacity=4096)
    comm.set_oneshot_bound(1024)
    small = torch.ones(2, 256, dtype=torch.bfloat16)  # exactly the bound
    assert comm.all_reduce(small) is small and fake.calls == [((2, 256), torch.bfloat16)]
    comm.all_reduce(torch.ones(4, 128, dtype=torch.float32))  # 2 KiB: over the bound, within the buffer
    comm.all_reduce(torch.ones(1, 256, dtype=torch.float16))  # a dtype the kernel lacks
    comm.all_reduce(torch.ones(256, 2, dtype=torch.bfloat16).t())  # not contiguous
    comm.all_reduce(torch.ones(1, 3, dtype=torch.float32))  # 12 bytes: not whole 16-byte vectors
    assert fake.calls == [((2, 256), torch.bfloat16)]
    ones = torch.ones(4, 128)
    assert torch.equal(comm.all_reduce(ones), torch.ones(4, 128))  # the group's sum of one rank


def test_a_zero_bound_releases_the_buffer_and_routes_everything_to_the_group(comm):
    fake = comm.oneshot = CpuOneShot(capacity=4096)
    comm.set_oneshot_bound(0)
    assert comm.oneshot is None and fake.closed
    comm.all_reduce(torch.ones(2, 256, dtype=torch.bfloat16))
    assert fake.calls == []


def test_a_bound_without_a_buffer_stays_zero(comm):
    comm.set_oneshot_bound(1 << 20)
    assert comm.oneshot_bound == 0 and not comm.routes_to_oneshot(torch.ones(1, 256, dtype=torch.bfloat16))


def test_setup_on_cpu_says_why_and_keeps_the_group(comm):
    why = comm.setup_oneshot(torch.device("cpu"), 4096)
    assert "CUDA" in why and comm.oneshot is None
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))


def test_the_group_is_registered_by_name_for_the_rendezvous_and_unregistered_when_it_fails(comm, monkeypatch):
    import torch.distributed._symmetric_memory as symm_mem

    seen = {}

    def rendezvous(buffer, name):  # what symm_mem's C++ rendezvous looks up: the group registered under `name`
        group = c10d._resolve_process_group(name)
        seen.update(rank=group.rank(), size=group.size(), name=group.group_name, bytes=buffer.numel())
        raise RuntimeError("no P2P between these devices")

    import brrr.distributed.oneshot as oneshot

    monkeypatch.setattr(oneshot, "_rendezvous_begun", 0)  # this process's count, restored after the test
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.empty(n, dtype=dtype))
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(symm_mem, "get_backend", lambda device: None)
    why = comm.setup_oneshot(torch.device("cuda", 0), 4096)
    assert why == "RuntimeError: no P2P between these devices" and comm.oneshot is None
    assert seen == {"rank": 0, "size": 1, "name": "brrr-test-oneshot", "bytes": 4096}
    # counted at the attempt: whether PyTorch's counter moved depends on where it failed, and a later engine on NCCL
    # for nothing costs less than one that hangs
    assert oneshot.rendezvous_begun() == 1
    with pytest.raises(RuntimeError):  # released: a later engine may take the name
        c10d._resolve_process_group("brrr-test-oneshot")


def test_capacity_must_be_whole_vectors(comm):
    with pytest.raises(ValueError, match="multiple of 16"):
        OneShotAllReduce.create(comm.group, comm.store, 0, 1, torch.device("cuda", 0), 1000, "brrr-bad")


class OneRankKernels:
    """symm_mem's two one-shot ops as they behave in a group of one rank (the sum of one buffer), on CPU."""

    @staticmethod
    def one_shot_all_reduce_copy_out(buffer, local, op, name, out):
        buffer.copy_(local)
        return out.copy_(buffer)

    @staticmethod
    def one_shot_all_reduce(buffer, op, name):
        return buffer.clone()


@pytest.mark.parametrize("offset", [0, 8, 1], ids=["aligned", "aligned-view", "off-by-2-bytes"])
def test_the_message_passes_through_the_symmetric_buffer_and_back_in_place(monkeypatch, offset):
    monkeypatch.setattr(torch.ops, "symm_mem", OneRankKernels)
    one = OneShotAllReduce(torch.zeros(4096, dtype=torch.uint8), "cpu-oneshot", None)
    base = torch.arange(8 + 2 * 64, dtype=torch.bfloat16)
    t = base[offset: offset + 2 * 64].view(2, 64)
    message = t.clone()
    assert one(t) is t and torch.equal(t, message)  # one rank: the sum is the message, written back into t
    assert torch.equal(one.buffer.view(torch.bfloat16)[: t.numel()], message.view(-1))


def test_a_torch_without_the_one_shot_ops_falls_back_before_registering(comm, monkeypatch):
    monkeypatch.setattr(torch.ops, "symm_mem", object())
    why = comm.setup_oneshot(torch.device("cuda", 0), 4096)
    assert why.startswith("RuntimeError: this torch") and "one_shot_all_reduce" in why and comm.oneshot is None
    with pytest.raises(RuntimeError):
        c10d._resolve_process_group("brrr-test-oneshot")


class Proc:
    def __init__(self, exitcode=None):
        self.exitcode = exitcode


class Launched:
    """A CUDA event as the watchdog reads it: whether the step recorded before it has finished."""

    def __init__(self, done: bool):
        self.done = done

    def query(self):
        return self.done


def _watch(procs, launched, stuck_after_s=0.05, launching=False):
    fired = []
    dog = LaunchWatchdog(procs, stuck_after_s, on_stuck=fired.append, poll_s=0.01)
    dog.launched, dog.launching = launched, launching
    dog.start()
    time.sleep(0.3)
    dog.stop()
    return fired


def test_the_watchdog_acts_when_a_worker_died_and_the_launched_step_never_ends():
    fired = _watch([Proc(), Proc(exitcode=-9)], Launched(done=False))
    assert len(fired) == 1 and "worker rank 2 exited" in fired[0] and "one-shot" in fired[0]


def test_the_watchdog_acts_when_a_worker_died_and_the_host_is_stuck_launching():
    assert len(_watch([Proc(exitcode=-9)], None, launching=True)) == 1  # e.g. a host read inside the step


@pytest.mark.parametrize("procs, launched", [
    ([Proc(), Proc()], Launched(done=False)),  # a long step with every worker alive: not stuck
    ([Proc(exitcode=1)], Launched(done=True)),  # a dead worker, the GPU idle: the engine's own check sees it
    ([Proc(exitcode=1)], None),  # nothing launched yet
], ids=["workers-alive", "gpu-idle", "nothing-launched"])
def test_the_watchdog_leaves_alone_what_is_not_a_hang(procs, launched):
    assert _watch(procs, launched) == []


def test_a_stopped_watchdog_does_not_act():
    fired = []
    dog = LaunchWatchdog([Proc(exitcode=1)], 0.0, on_stuck=fired.append, poll_s=0.05)
    dog.launched = Launched(done=False)
    dog.stop()  # the runner's shutdown: workers stopping on purpose
    dog.start()
    dog._thread.join(1)
    assert not dog._thread.is_alive() and fired == []
