"""Log-softmax over the last dim, each row's bits independent of the other rows: the sampler's logprobs and a
trainer's recomputation of them run this one op, so they agree bit for bit.

- `log_softmax_ref` (CPU): torch's. Its CPU kernel reduces each row on one thread in one vectorized order and
  splits only across rows (a probe over 1 to 8 rows of 256 to 152k logits found no difference), so it is
  row-invariant as it stands.
- `log_softmax_triton` (CUDA): one program a row, three passes over the row in fixed BLOCK-wide chunks (max, sum
  of exp, write), so neither the batch's size nor the launch changes a row's order. torch's CUDA kernel is not used:
  nothing promises that its launch (threads a row) stays a function of the row length alone.
Under autograd the Triton form's backward is softmax's usual one, in torch.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import triton_on

BLOCK = 1024  # logits a pass step reads


def log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, -1)


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    @triton.jit
    def _log_softmax_kernel(X, Y, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        # pass 1: the row's max, lane by lane over the chunks, then across the lanes
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        for c in range(0, n_cols, BLOCK):
            x = tl.load(X + row * stride_x + c + cols, mask=c + cols < n_cols, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, x)
        row_max = tl.max(m, 0)
        # pass 2: the sum of exp(x - max), the same way
        s = tl.zeros((BLOCK,), tl.float32)
        for c in range(0, n_cols, BLOCK):
            x = tl.load(X + row * stride_x + c + cols, mask=c + cols < n_cols, other=float("-inf")).to(tl.float32)
            s += tl.exp(x - row_max)
        log_sum = tl.log(tl.sum(s, 0)) + row_max
        for c in range(0, n_cols, BLOCK):
            x = tl.load(X + row * stride_x + c + cols, mask=c + cols < n_cols, other=0.0).to(tl.float32)
            tl.store(Y + row * stride_y + c + cols, (x - log_sum).to(Y.dtype.element_ty), mask=c + cols < n_cols)


def log_softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] with a unit-stride last dim."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), out.stride(0), BLOCK=BLOCK,
                                            num_warps=4)
    return out.view(x.shape)


class _TritonLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = log_softmax_triton(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad - y.exp() * grad.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax(x, -1), row-invariant on every device (see the module's docstring)."""
    if triton_on(x) and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _TritonLogSoftmax.apply(x)
    return log_softmax_ref(x)
