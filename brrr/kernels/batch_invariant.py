"""The batch-invariant mode: inside `with batch_invariant():` every op whose result could depend on the batch's size
or composition runs a form that does not, so a row's bits are a function of that row (and its sequence's earlier
tokens) alone. The engine runs its model inside it when built with `batch_invariant=True`; a trainer runs its
forward inside it to recompute the engine's logprobs bit for bit (docs/batch-invariance.md).

What the mode changes, all from this one switch:
- matmuls: F.linear, torch.matmul / `@`, torch.mm and torch.addmm with a 2-D right operand are routed, by a
  torch-function mode, to `invariant_matmul.mm_invariant` (fixed reduction order, no split-K). The models' nn.Linear
  layers, lm_head and any adapter's matmuls go through it without a module swap.
- attention: `attention` takes `attention/invariant.py`, each query row over its keys in fixed chunks of absolute
  positions, the same code for a decode, a prefill chunk, a prefix-cache hit and a full-sequence forward.
- RMSNorm: `rms_norm`'s invariant form (a row's sum of squares in one order, never split across threads).
- everything else takes its plain-torch reference (`dispatch.use_triton` says no inside the mode): elementwise ops
  are batch-invariant already, and a trainer under autograd runs the same code the engine runs.
The sampler's log-softmax (`log_softmax.py`) is row-invariant in every mode.

Thread-local, like torch's function modes: a model in another thread is not switched with this one. Nestable.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from brrr.kernels.dispatch import batch_invariant_on, enter_batch_invariant
from brrr.kernels.invariant_matmul import linear_invariant, mm_invariant

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_ADDMMS = {torch.addmm, torch.Tensor.addmm}


def _floating_2d_rhs(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() == 2
            and a.dtype == b.dtype and a.is_floating_point())


class _RouteMatmuls(TorchFunctionMode):
    """Sends every row-batched matmul (a 2-D right operand) to the invariant one; anything else runs as called
    (batched matmuls of two 3-D operands do not occur in the models' forward under the mode)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _floating_2d_rhs(x, weight):
                return linear_invariant(x, weight, bias)
        elif func in _MATMULS and not kwargs and len(args) == 2 and _floating_2d_rhs(*args):
            return mm_invariant(*args)
        elif func in _ADDMMS and len(args) == 3 and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1 \
                and _floating_2d_rhs(args[1], args[2]):
            return args[0] + mm_invariant(args[1], args[2])
        return func(*args, **kwargs)


_modes = threading.local()  # this thread's pushed routing mode while its depth is above zero


@contextlib.contextmanager
def batch_invariant():
    """Run the block in the batch-invariant mode (see the module's docstring). Entering it again inside is free."""
    if enter_batch_invariant(+1) == 1:
        _modes.route = _RouteMatmuls()
        _modes.route.__enter__()
    try:
        yield
    finally:
        if enter_batch_invariant(-1) == 0:
            _modes.route.__exit__(None, None, None)
            _modes.route = None


__all__ = ["batch_invariant", "batch_invariant_on"]
