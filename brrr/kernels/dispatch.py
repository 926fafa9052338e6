"""When an op runs its Triton kernel and when its plain-torch reference.

Triton runs when every tensor is on CUDA, triton imports, no tensor needs a gradient (the kernels have no
backward; training takes the reference, which autograd differentiates) and torch.compile is not tracing (inductor
fuses the reference itself). `BRRR_KERNELS=ref` in the environment at start-up forces the reference everywhere
(debugging); `use_reference()` does the same for a block of code. Inside the batch-invariant mode
(brrr/kernels/batch_invariant/) every op takes its reference too, the same code under autograd and in inference, and
the ops whose result depends on the batch take their invariant forms instead.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

# depth of `use_reference()` blocks, plus one for BRRR_KERNELS=ref (read once: not on every op's dispatch)
_forced_reference = int(os.environ.get("BRRR_KERNELS", "").lower() == "ref")
# depth of batch-invariant blocks in this thread (`brrr.kernels.batch_invariant.batch_invariant`): thread-local, as
# the torch-function mode that routes its matmuls is, so another thread's model is not switched with it
_invariant = threading.local()


def batch_invariant_on() -> bool:
    """Whether this thread is inside the batch-invariant mode."""
    return getattr(_invariant, "depth", 0) > 0


def enter_batch_invariant(step: int) -> int:
    """Add step (+1 entering, -1 leaving) to this thread's depth of batch-invariant blocks; returns the new depth."""
    _invariant.depth = getattr(_invariant, "depth", 0) + step
    return _invariant.depth


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a triton whose native parts fail to load
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    if _forced_reference or batch_invariant_on():
        return False
    if not all(t.is_cuda for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if torch.compiler.is_compiling():
        return False
    return triton_available()


def triton_on(*tensors: torch.Tensor) -> bool:
    """Whether the batch-invariant ops run their Triton forms: every tensor on CUDA, triton importable, no forced
    reference, no torch.compile trace. Gradients are no bar: those ops carry their own backward."""
    return (not _forced_reference and all(t.is_cuda for t in tensors) and not torch.compiler.is_compiling()
            and triton_available())


def fast_path(device: torch.device | str) -> bool:
    """Whether ops on `device` take the Triton kernels here and now."""
    return use_triton(torch.empty(0, device=device))


@contextlib.contextmanager
def use_reference():
    """Run every op through its plain-torch reference inside this block (a peer for benchmarks and tests)."""
    global _forced_reference
    _forced_reference += 1
    try:
        yield
    finally:
        _forced_reference -= 1


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (its index, or the current one); 132 (an H100's or H200's) off the GPU, where launch
    rules are only checked."""
    if device.type != "cuda":
        return 132
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


ARRIVAL_SLOTS = 1 << 14  # counters a device has: more than any launch asks for (fewer programs than a few waves)
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counts(device, n: int) -> torch.Tensor:
    """int32 counters for kernels whose last-arriving program finishes a job (split-K GEMMs, split-KV decode):
    zeroed once and left at zero by every launch that uses them, so kernels in one stream share them. One buffer a
    device, allocated at its full size on first use and never replaced: captured CUDA graphs hold its address."""
    if n > ARRIVAL_SLOTS:
        raise ValueError(f"{n} arrival counters asked for, at most {ARRIVAL_SLOTS} exist")
    counts = _ARRIVALS.get(device)
    if counts is None:
        counts = _ARRIVALS[device] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return counts
