"""The one CPU-threads policy, for every entry point that runs torch on the CPU: `brrr generate`, `chat`, `serve`
(its engine process), `bench`, `train`, `finetune`, and `LLM(...)` (docs/serving.md, "CPU threads").

Torch's default is one intra-op thread per core. On a machine other work also uses, that oversubscribes it: a decode
or training step then waits on whichever thread was descheduled (measured on a 2-core VM under load: finetune 20-40x
slower than on the quiet machine, `LLM` 3x faster with one thread). So: what the caller asked for; else
OMP_NUM_THREADS when set (torchrun sets it to 1 for each of several local processes); else the cores this process may
run on, less one (the HTTP side, the data loader, the OS) and less the cores other processes keep busy now (the
1-minute load average), and never below one."""
from __future__ import annotations

import os


def cpu_threads(requested: int | None = None) -> int:
    if requested is not None:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        busy = 0.0
    return max(1, min(cores - 1, int(cores - busy)))


def use_cpu_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads by the policy; returns the count."""
    import torch

    threads = cpu_threads(requested)
    torch.set_num_threads(threads)
    return threads
