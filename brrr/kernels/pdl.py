"""Programmatic dependent launch (PDL, sm_90 and later) for the decode-path kernels.

A decode step is ~10 kernels a layer, most of them a few microseconds long, so the gap between one kernel's end
and the next one's first instruction is a real share of the step. Launched with PDL, a kernel may start while the
kernel before it in the stream is still finishing. Each of brrr's PDL kernels calls `wait_previous` as its first
statement, in every program: `griddepcontrol.wait` blocks until the previous grid has completed and its writes are
visible. Nothing is read or written before it, so the overlap is launch and set-up only, and the kernel is safe after
any kernel, PDL or not. Because every program waits before it can finish, a kernel never completes before the
one it follows, so a chain of PDL kernels stays ordered. `BRRR_PDL=0` turns it off, `BRRR_PDL=1` keeps the wait but not the early launch (A/B runs).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except Exception:  # no triton, or one without grid dependency control: PDL stays off
    HAVE_GDC = False


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(t: torch.Tensor) -> int:
    """The `PDL` constexpr for kernels on t's device (launched with `launch_pdl=PDL > 0`): 0 plain launches; 1 wait
    for the previous kernel first; 2 (the default) also let the next kernel launch right after that wait."""
    mode = int(os.environ.get("BRRR_PDL", "2"))
    return mode if HAVE_GDC and t.is_cuda and _device_supports(t.device.index or 0) else 0


if triton is not None:

    @triton.jit
    def wait_previous(PDL: tl.constexpr):
        """First statement of a PDL kernel: wait for the previous grid, then (PDL 2) let the next one launch."""
        if PDL > 0:  # 0 whenever HAVE_GDC is False
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """PDL 3: the next kernel may launch from here (a GEMM's epilogue), not right after the wait."""
        if PDL == 3:
            gdc_launch_dependents()
