"""`brrr bench train --profile DIR`: one more step after the timed ones, under torch.profiler, so the time of a
training step can be split by kernel (and set beside a peer's). Per rank (or per model, alone) it writes
DIR/<tag>.trace.json (a chrome trace: chrome://tracing or ui.perfetto.dev) and DIR/<tag>.kernels.txt, the 20
kernels with the most total GPU time (on CPU, the 20 ops with the most self CPU time), and returns that table.
Shares are of all kernels' summed time, which exceeds the step's wall time where streams overlap (FSDP2's NCCL
kernels run beside the matmuls). The profiled step is not one of the timed ones: the profiler's own overhead stays
out of the tokens/s.
"""
from __future__ import annotations

import time
from pathlib import Path

TOP = 20


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
    (out / f"{tag}.kernels.txt").write_text(table + "\n")
    return table


def kernel_table(events, micros, kind: str, total_us: float, tag: str) -> str:
    """The first TOP events as a fixed-width table: name, calls, total ms, share of all of `kind`'s time, us per
    call (`micros(e)`: an event's total time in microseconds)."""
    lines = [f"{tag}: top {TOP} {kind}s by total time, of {total_us / 1e3:,.1f} ms in all",
             f"{'ms':>9} {'share':>6} {'calls':>6} {'us/call':>9}  name"]
    for e in events[:TOP]:
        us = micros(e)
        lines.append(f"{us / 1e3:9.2f} {us / max(total_us, 1e-9):6.1%} {e.count:6d} {us / max(e.count, 1):9.1f}  "
                     f"{e.key[:140]}")
    return "\n".join(lines)
