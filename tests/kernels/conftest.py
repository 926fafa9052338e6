"""Kernel tests: each Triton kernel against its plain-torch reference.

On a machine without CUDA they run through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before anything imports triton, since `triton.jit` picks the interpreter when a kernel is defined). They are
skipped, with the reason, when triton does not import or the kernels were compiled for a GPU this machine lacks.
"""
import pytest
import torch

from brrr.kernels.dispatch import triton_available


def _interpreted() -> bool:
    from brrr.kernels.rms_norm import _rms_norm_kernel

    return type(_rms_norm_kernel).__name__ == "InterpretedFunction"


@pytest.fixture
def device():
    """Where the kernels run: the GPU when there is one, else the CPU through Triton's interpreter."""
    if not triton_available():
        pytest.skip("triton is not importable here (pip install triton)")
    if torch.cuda.is_available() and not _interpreted():
        return "cuda"
    if not _interpreted():
        pytest.skip("no CUDA GPU and the kernels were not built for Triton's interpreter "
                    "(TRITON_INTERPRET=1 must be set before triton is imported)")
    return "cpu"
