"""Device time of GPU work through CUDA graphs: captured calls replayed back to back, timed with events, so
launch gaps and host work stay out of the figure."""
from __future__ import annotations

import torch

from brrr.kernels.graph_timing import graph_time_us, replay_time_us

__all__ = ["graph_time_us", "replay_time_us", "step_kernels"]


def step_kernels(graph, replays: int = 20) -> list[tuple[str, float, float]]:
    """(kernel name, device us a step, launches a step) of a captured step: torch.profiler over replays (under PDL
    a kernel's time includes its wait for the one before)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()]
    return sorted(((k, t / replays, c / replays) for k, t, c in rows if t > 0), key=lambda r: -r[1])
