"""brrr/kernels/dispatch.py on the CPU: the per-op dispatch reads no environment, and the arrival counters that
captured CUDA graphs hold by address are never reallocated."""
import os

import pytest
import torch

from brrr.kernels import dispatch


class CountingEnviron(dict):
    reads = 0

    def get(self, *args):
        CountingEnviron.reads += 1
        return super().get(*args)

    def __getitem__(self, key):
        CountingEnviron.reads += 1
        return super().__getitem__(key)


def test_dispatch_reads_no_environment_per_op(monkeypatch):
    monkeypatch.setattr(os, "environ", CountingEnviron(os.environ))
    x = torch.zeros(2)
    for _ in range(3):
        assert not dispatch.use_triton(x)
    assert CountingEnviron.reads == 0


def test_arrival_counts_are_one_buffer_a_device_never_reallocated():
    """A graph captured with the counters of a small launch must still own them after a larger launch asks: the
    buffer keeps its address (before, a larger request replaced it and freed the one the graph wrote to)."""
    dev = torch.device("cpu")
    small = dispatch.arrival_counts(dev, 8)
    large = dispatch.arrival_counts(dev, dispatch.ARRIVAL_SLOTS)
    assert large.data_ptr() == small.data_ptr() and large.numel() >= dispatch.ARRIVAL_SLOTS
    assert int(large.sum()) == 0
    with pytest.raises(ValueError, match="arrival counters"):
        dispatch.arrival_counts(dev, dispatch.ARRIVAL_SLOTS + 1)
