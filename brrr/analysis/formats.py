"""Bytes of a weight matrix or a KV-cache element in each storage format, scales included.

Weight formats (for linear-layer weights; embeddings, norms and biases stay at 16 bits, or 32 under fp32):
  fp32, bf16, fp16    4 / 2 / 2 bytes per element
  fp8                 1 byte per element + one fp32 scale per matrix (per-tensor scaling)
  int8                1 byte per element + one bf16 scale per output row (per-channel, weight-only)
  int4, int4-g<N>     half a byte per element + a bf16 scale and a bf16 zero point per group of N input
                      elements of a row (N = 128 by default; the layout of gpt-fast's tinygemm int4)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from brrr.errors import BrrrError


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int
    group_size: int = 0  # > 0: one scale group per group_size input elements of a row
    scale_bytes_per_group: int = 0
    scale_bytes_per_row: int = 0
    scale_bytes_per_matrix: int = 0

    def matrix_bytes(self, rows: int, cols: int) -> float:
        """Bytes of one rows x cols (out x in) weight matrix in this format."""
        data = rows * cols * self.bits / 8
        groups = rows * math.ceil(cols / self.group_size) if self.group_size else 0
        return (data + groups * self.scale_bytes_per_group + rows * self.scale_bytes_per_row
                + self.scale_bytes_per_matrix)

    @property
    def other_bytes(self) -> int:
        """Bytes per element of the parameters a weight format leaves unquantized."""
        return 4 if self.bits == 32 else 2

    @property
    def compute_dtype(self) -> str:
        """The tensor-core dtype its matmuls run in: fp8 weights use fp8 GEMMs (W8A8, as fp8 serving does);
        int8/int4 weight-only formats dequantize to bf16; fp32 uses fp32."""
        return {"fp32": "fp32", "fp16": "fp16", "fp8": "fp8"}.get(self.name, "bf16")


def dtype_format(dtype) -> str:
    """The weight format of unquantized weights in a torch dtype (or its name): bfloat16 -> bf16, and so on."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[str(dtype).removeprefix("torch.")]


_SIMPLE = {
    "fp32": WeightFormat("fp32", 32), "bf16": WeightFormat("bf16", 16), "fp16": WeightFormat("fp16", 16),
    "fp8": WeightFormat("fp8", 8, scale_bytes_per_matrix=4),
    "int8": WeightFormat("int8", 8, scale_bytes_per_row=2),
}
WEIGHT_FORMATS = (*_SIMPLE, "int4", "int4-g<N>")
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def weight_format(name: str | WeightFormat) -> WeightFormat:
    if isinstance(name, WeightFormat):
        return name
    key = name.lower()
    if key in _SIMPLE:
        return _SIMPLE[key]
    m = re.fullmatch(r"int4(?:-g(\d+))?", key)
    if m and (m.group(1) is None or int(m.group(1)) > 0):
        group = int(m.group(1) or 128)
        return WeightFormat(f"int4-g{group}", 4, group_size=group, scale_bytes_per_group=4)
    raise BrrrError(f"unknown weight format {name!r}; known: {', '.join(WEIGHT_FORMATS)}")


def kv_bytes(name: str) -> int:
    """Bytes per KV-cache element."""
    if name.lower() not in KV_BYTES:
        raise BrrrError(f"unknown KV-cache dtype {name!r}; known: {', '.join(KV_BYTES)}")
    return KV_BYTES[name.lower()]
