"""Programmatic dependent launch (PDL, sm_90 and later) for the decode-path kernels.

A decode step is ~10 kernels a layer, most a few microseconds long, so the time between one kernel's last
instruction and the next one's first is a real share of the step. A kernel launched with PDL may be scheduled
before the previous kernel in the stream has finished, once every program of that kernel has called
`griddepcontrol.launch_dependents` (or exited). Each PDL kernel calls `wait_previous` before its first memory
access, in every program: `griddepcontrol.wait` blocks until the previous grid has completed and its writes are
visible. So the overlap is launch and set-up only, the kernel is safe after any kernel (PDL or not), and since no
program can finish before its wait returns, a kernel never completes before the one it follows.

The `PDL` constexpr says where a kernel lets the next one launch: 0 plain launch; 1 wait, no early launch; 2
right after the wait (the short kernels); 3 from the epilogue (`release_dependents`: the quantized GEMMs at batch
<= 4, where releasing right after the wait made the step slower). Kernels that read constants (weights, scales,
block tables, a decode's cached keys) load their first ones before the wait, so under PDL that latency overlaps the
previous kernel. Safe by the rule above: a kernel starts only once the one before the previous has completed, so
before its wait it may read anything the previous kernel does not write.
"""
from __future__ import annotations

import contextlib
import functools

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


_plain = 0  # depth of `plain_launches()` blocks


@contextlib.contextmanager
def plain_launches():
    """Launch every kernel without PDL inside this block (a test's peer: PDL must change when kernels start, never
    what they compute). Kernels are launched, and graphs captured, with the mode of the moment."""
    global _plain
    _plain += 1
    try:
        yield
    finally:
        _plain -= 1


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(t: torch.Tensor) -> int:
    """The `PDL` mode for kernels on t's device (launched with `launch_pdl=PDL > 0`): 2 on sm_90+, 0 on older
    GPUs, the CPU, without grid dependency control and inside `plain_launches()`."""
    return 2 if not _plain and HAVE_GDC and t.is_cuda and _device_supports(t.device.index or 0) else 0


if triton is not None:

    @triton.jit
    def wait_previous(PDL: tl.constexpr):
        """Before a PDL kernel's first memory access: wait for the previous grid; PDL 2: then release the next."""
        if PDL > 0:  # 0 whenever HAVE_GDC is False
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """PDL 3: the next kernel may launch from here (a GEMM's epilogue)."""
        if PDL == 3:
            gdc_launch_dependents()
