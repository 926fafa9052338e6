"""2:4 projections on CUDA through PyTorch's semi-structured sparse tensors (torch.sparse.to_sparse_semi_structured:
cuSPARSELt, or CUTLASS): the weight is stored compressed (its nonzero half plus 2-bit position metadata, 9/16 of
the dense bytes) and the GEMM skips the zeros on the sparse tensor cores (Ampere and later). A module swap where a
loaded model is made ready to run (the engine's prepare_for_serving, `brrr eval`), as quantization's QuantLinear
is; not in brrr.loader, since quantizing, distilling or pruning further need the dense weights. On the CPU, or
where the dtype, the shape or the GPU does not allow it, the projection stays a dense nn.Linear holding the same
zeros.

Where it is faster: the sparse GEMM is not always the faster one (on an H200, cuSPARSELt's 2:4 down projection
runs at 0.28-0.72x of cuBLAS's dense GEMM from 1 to 256 rows, bench/results/sparse_speed_h200.jsonl), so a shape
is swapped only where this GPU times it faster than the dense GEMM at a decode step's rows and a prefill chunk's
(`sparse_is_faster`, once per GPU, shape and dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brrr.prune.mask import is_n_m

DTYPES = (torch.float16, torch.bfloat16)
MIN_ROWS, MIN_COLS = 32, 64  # the CUTLASS backend's minimum sparse block (cuSPARSELt's is 16 x 16): either runs it
TIMED_ROWS = (16, 2048)  # a batch-16 decode step's rows and a prefill chunk's: the sparse GEMM must win at both
_faster: dict[tuple, bool] = {}  # (GPU name, dtype, out, in) -> sparse_is_faster's answer


def supports_semi_structured(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """The one rule for where a 2:4 projection runs sparse: a CUDA device with sparse tensor cores (compute
    capability 8.0+), a 16-bit dtype, and a weight that tiles into the kernels' minimum blocks."""
    if device.type != "cuda" or dtype not in DTYPES or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] < 8:
        return False
    return out_features % MIN_ROWS == 0 and in_features % MIN_COLS == 0


def _median_ms(fn, iters: int = 20) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[iters // 2]


def sparse_is_faster(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether the 2:4 GEMM of an [out, in] weight beats the dense GEMM on this GPU at every TIMED_ROWS (timed on
    a random 2:4 weight of the shape: speed does not depend on the values; the answer is kept per GPU and shape)."""
    key = (torch.cuda.get_device_name(device), dtype, out_features, in_features)
    if key not in _faster:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=gen)
        w = w * torch.tensor([1, 1, 0, 0], device=device, dtype=dtype).repeat(in_features // 4)  # 2 of each 4
        sparse = torch.sparse.to_sparse_semi_structured(w)
        wins = []
        for m in TIMED_ROWS:
            x = torch.randn(m, in_features, device=device, dtype=dtype, generator=gen)
            wins.append(_median_ms(lambda: F.linear(x, sparse)) < _median_ms(lambda: F.linear(x, w)))
        _faster[key] = all(wins)
    return _faster[key]


class SemiSparseLinear(nn.Module):
    """y = x W^T + b with W a SparseSemiStructuredTensor (F.linear dispatches to the sparse GEMM, which pads the
    token dimension to the kernel's minimum itself)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.sparse.to_sparse_semi_structured(weight.detach().contiguous()),
                                   requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "SemiSparseLinear":
        return cls(linear.weight, linear.bias)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the sparse GEMM may hand back a transposed view; the attention and activation kernels read rows
        return F.linear(x, self.weight, self.bias).contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 2:4 semi-structured"


def swap_semi_structured(model) -> list[str]:
    """Replace each nn.Linear of the decoder layers (the projections, or the serving form's packed qkv and gate_up)
    whose weight is 2:4, that `supports_semi_structured` allows and whose shape the sparse GEMM runs faster
    (`sparse_is_faster`) with a SemiSparseLinear, in place. Returns the names swapped (none on the CPU, none for a
    dense model, none where the dense GEMM is the faster one)."""
    swapped = []
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or ".layers." not in f".{name}":
            continue
        w = linear.weight
        if not supports_semi_structured(w.device, w.dtype, *w.shape) or not is_n_m(w, 2, 4):
            continue
        if not sparse_is_faster(w.device, w.dtype, *w.shape):
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, SemiSparseLinear.from_linear(linear))
        swapped.append(name)
    return swapped
