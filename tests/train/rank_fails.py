"""`brrr train` under torchrun, its rank 1 raising at its third optimizer step (a stand-in for any failure inside a
step: an out-of-memory, a kernel error): tests/train/test_distributed_launch.py runs it."""
import os
import sys

from brrr.cli import main
from brrr.train.parallel import ParallelStep

real_step, calls = ParallelStep.__call__, []


def step(self, *args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        raise RuntimeError("rank 1 failed inside its step")
    return real_step(self, *args, **kwargs)


ParallelStep.__call__ = step
sys.exit(main(sys.argv[1:]))
