"""brrr's one CPU-threads policy (brrr/threads.py), and that each entry point follows it: the CLI's subcommands
(train and finetune among them, which used every core), the engine process and LLM()."""
import os

import pytest
import torch

from brrr import threads
from brrr.cli import main


@pytest.fixture
def machine(monkeypatch):
    """A machine of `cores` cores with `load` of other work, and no OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def set_machine(cores, load):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    return set_machine


@pytest.mark.parametrize("cores, load, want", [(16, 0.0, 15), (16, 6.3, 9), (2, 0.0, 1), (2, 5.0, 1), (1, 0.0, 1),
                                               (8, 1.0, 7)])
def test_policy(machine, cores, load, want):
    machine(cores, load)
    assert threads.cpu_threads() == want and threads.cpu_threads(3) == 3


def test_omp_num_threads_wins(machine, monkeypatch):
    machine(16, 0.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torchrun's per-process setting
    assert threads.cpu_threads() == 2 and threads.cpu_threads(5) == 5


def test_every_cli_command_and_llm_follow_it(machine, tmp_path, capsys):
    machine(8, 2.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert main(["calc", "model", "llama-3.2-1b"]) == 0  # a command without --cpu-threads: the policy
        assert torch.get_num_threads() == 6
        from brrr.engine import LLM

        torch.set_num_threads(1)
        LLM(dtype="float32", device="cpu")
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)
