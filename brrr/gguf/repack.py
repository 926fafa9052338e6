"""GGUF blocks -> brrr's group-wise weight-only layouts (brrr/kernels/quant/groupwise.py), every value kept: the
codes widened or copied, the super-block d / dmin kept fp16, the 6-bit sub-block scales and mins unpacked to
one byte each. `dequantize_groupwise` of the result equals `gguf.quants.dequantize` bit for bit."""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from brrr.errors import BrrrError
from brrr.gguf.dequant import _nibbles, _u8, k_scale_min

REPACKABLE = {T.Q8_0: "q8_0", T.Q6_K: "q6_k", T.Q5_K: "q5_k", T.Q4_K: "q4_k"}


def _f16(b: torch.Tensor, rows: int) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(rows, -1)


def repack_groupwise(blocks: torch.Tensor, qtype: T, rows: int, cols: int) -> tuple[str, dict]:
    """Raw bytes of a [rows, cols] tensor of type qtype -> (fmt, its group-wise tensors)."""
    if qtype not in REPACKABLE:
        raise BrrrError(f"GGUF type {qtype.name} has no group-wise layout (those with one: "
                        f"{', '.join(t.name for t in REPACKABLE)})")
    b = blocks.reshape(-1).view(torch.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    n = b.shape[0]
    if qtype == T.Q8_0:
        return "q8_0", {"qweight": b[:, 2:].contiguous().view(torch.int8).reshape(rows, cols),
                        "scales": _f16(b[:, :2], rows)}
    if qtype == T.Q6_K:
        ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
        low = _nibbles(ql, 2).reshape(n, -1, 32)
        high = (qh.reshape(n, -1, 1, 32) >> _u8([0, 2, 4, 6], b).reshape(1, 1, 4, 1)) & 3
        q = (low | (high.reshape(n, -1, 32) << 4)).to(torch.int8) - 32
        return "q6_k", {"qweight": q.reshape(rows, cols), "scales": scales.contiguous().view(torch.int8)
                        .reshape(rows, -1), "d": _f16(b[:, 208:210], rows)}
    sc, mn = k_scale_min(b[:, 4:16])
    tensors = {"scales": sc.reshape(rows, -1).contiguous(), "d": _f16(b[:, :2], rows),
               "mins": mn.reshape(rows, -1).contiguous(), "dmin": _f16(b[:, 2:4], rows)}
    if qtype == T.Q4_K:  # the file's nibble order is the layout's: copied
        return "q4_k", {"qweight": b[:, 16:].reshape(rows, cols // 2).contiguous(), **tensors}
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = _nibbles(qs, 4).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _u8(range(8), b).reshape(1, 1, 8, 1)) & 1).reshape(n, -1, 32)
    return "q5_k", {"qweight": (ql | (high << 4)).to(torch.int8).reshape(rows, cols), **tensors}
