"""`brrr bench train --profile DIR`: one more step after the timed ones, under torch.profiler, so the time of a
training step can be split by kernel (and set beside a peer's). Per rank (or per model, alone) it writes
DIR/<tag>.trace.json (a chrome trace: chrome://tracing or ui.perfetto.dev) and DIR/<tag>.kernels.txt, the 20
kernels with the most total GPU time (on CPU, the 20 ops with the most self CPU time), and returns that table.
Shares are of all kernels' summed time, which exceeds the step's wall time where streams overlap (FSDP2's NCCL
kernels run beside the matmuls); on GPUs a first line splits the step's span into compute, NCCL, NCCL that no
compute hides, and idle. The profiled step is not one of the timed ones: the profiler's own overhead stays
out of the tokens/s.
"""
from __future__ import annotations

import json
import time
from pathlib import Path


def profile_step(step, out_dir: str, tag: str, device) -> str:
    """Run `step()` once under the profiler; write the trace and the kernel table; return the table."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - start
    prof.export_chrome_trace(str(out / f"{tag}.trace.json"))
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        micros = lambda e: e.self_device_time_total
    else:
        events = list(prof.key_averages())
        micros = lambda e: e.self_cpu_time_total
    table = kernel_table(sorted(events, key=micros, reverse=True), micros, "GPU kernel" if cuda else "CPU op",
                         sum(micros(e) for e in events), f"{tag} (profiled step {wall_s * 1e3:,.1f} ms wall)")
    if cuda:
        table = overlap_line(json.loads((out / f"{tag}.trace.json").read_text())["traceEvents"]) + "\n" + table
    (out / f"{tag}.kernels.txt").write_text(table + "\n")
    return table


def kernel_table(events, micros, kind: str, total_us: float, tag: str, top: int = 20) -> str:
    """The first `top` events as a fixed-width table: name, calls, total ms, share of all of `kind`'s time, us per
    call (`micros(e)`: an event's total time in microseconds)."""
    lines = [f"{tag}: top {top} {kind}s by total time, of {total_us / 1e3:,.1f} ms in all",
             f"{'ms':>9} {'share':>6} {'calls':>6} {'us/call':>9}  name"]
    for e in events[:top]:
        us = micros(e)
        lines.append(f"{us / 1e3:9.2f} {us / max(total_us, 1e-9):6.1%} {e.count:6d} {us / max(e.count, 1):9.1f}  "
                     f"{e.key[:140]}")
    return "\n".join(lines)


def overlap_line(trace_events: list) -> str:
    """One line on how a step's GPU time splits: the span from its first kernel to its last, the time some compute
    kernel runs, the time some NCCL kernel runs, the NCCL time no compute kernel hides (what communication costs
    the step), and the time nothing runs. From a chrome trace's kernel events ({"cat": "kernel", "ts", "dur"})."""
    kernels = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return "no GPU kernels in the profiled step"
    is_comm = lambda e: "nccl" in e["name"].lower()
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e)])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e)])
    start, end = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    busy = _length(_union(comm + compute))
    exposed = _length(comm) - _length(_intersection(comm, compute))
    return (f"GPU span {(end - start) / 1e3:,.1f} ms: compute {_length(compute) / 1e3:,.1f} ms, NCCL "
            f"{_length(comm) / 1e3:,.1f} ms ({exposed / 1e3:,.1f} ms of it under no compute), idle "
            f"{(end - start - busy) / 1e3:,.1f} ms")


def _union(intervals: list) -> list:
    merged: list = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged


def _intersection(a: list, b: list) -> list:
    """Of two sorted unions (two pointers over them)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append([lo, hi])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list) -> float:
    return sum(hi - lo for lo, hi in intervals)
