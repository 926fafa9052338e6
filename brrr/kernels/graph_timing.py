"""Device time of GPU work through CUDA graphs: captured calls replayed back to back, timed with events, so
launch gaps and host work stay out of the figure (the quantized matmuls' tuner; brrr/bench)."""
from __future__ import annotations

import torch


def replay_time_us(graph, replays: int = 50) -> float:
    """Device time of one replay of an already captured graph (the engine's decode step)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def graph_time_us(calls, replays: int = 20) -> float:
    """Mean device time of one call: all `calls` captured in one CUDA graph, replayed `replays` times."""
    for c in calls:  # warm-up: compilation and tuning happen here, outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: an engine's other threads may call CUDA meanwhile, which would invalidate a global-mode capture
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
        for c in calls:
            c()
    return replay_time_us(graph, replays) / len(calls)
