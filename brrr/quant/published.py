"""Published 4-bit checkpoint layouts, read as they are stored and dequantized in torch.

GPTQ (AutoGPTQ / GPTQModel), per linear:
  qweight int32 [in/8, out]   8 input rows per int32, row 8i+k in bits 4k..4k+3
  qzeros  int32 [groups, out/8]  8 output columns per int32, column 8j+k in bits 4k..4k+3
  scales  fp16  [groups, out]
  g_idx   int32 [in]          the group of each input channel (act-order checkpoints permute it)
  w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]); checkpoint_format "gptq" (AutoGPTQ, the default)
  stores zero - 1, "gptq_v2" (GPTQModel) stores zero itself.
AWQ GEMM (AutoAWQ "version": "gemm"), per linear:
  qweight int32 [in, out/8], qzeros int32 [groups, out/8]: 8 output columns per int32, in the interleaved order
  (0, 2, 4, 6, 1, 3, 5, 7): bits 4k..4k+3 hold column 8j + AWQ_ORDER[k]
  scales fp16 [groups, out]; w[o, i] = scales[i // g, o] * (q[i, o] - zero[i // g, o]).
"""
from __future__ import annotations

import torch

from brrr.errors import BrrrError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_ON_DEVICE: dict = {}


def _on(name: str, make, device) -> torch.Tensor:
    """A small constant tensor on `device`, made once: act-order GPTQ dequantizes in every forward, and a copy from
    the CPU inside a CUDA-graph capture would fail."""
    if (name, device) not in _ON_DEVICE:
        _ON_DEVICE[name, device] = make().to(device)
    return _ON_DEVICE[name, device]


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor -> nibbles (int64), each int32 expanded into 8 along `dim` (nibble k = bits 4k..4k+3)."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _on("shifts", lambda: SHIFTS, packed.device)) & 0xF
    if dim == 0:
        return nibbles.permute(0, 2, 1).reshape(packed.shape[0] * 8, packed.shape[1]).long()
    return nibbles.reshape(packed.shape[0], packed.shape[1] * 8).long()


def dequantize_gptq(t: dict, zero_offset: int = 1) -> torch.Tensor:
    q = unpack_int32(t["qweight"], dim=0)  # [in, out]
    zeros = unpack_int32(t["qzeros"], dim=1) + zero_offset  # [groups, out]
    g = t["g_idx"].long()
    return ((q - zeros[g]) * t["scales"].float()[g]).T.contiguous()


def dequantize_gptq_v2(t: dict) -> torch.Tensor:
    return dequantize_gptq(t, zero_offset=0)


def _awq_unorder(x: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's interleave: column 8j + k of the unpacked nibbles holds output 8j + AWQ_ORDER[k]."""
    inverse = _on("awq_inverse", lambda: torch.tensor(sorted(range(8), key=lambda k: AWQ_ORDER[k])), x.device)
    return x.view(x.shape[0], -1, 8)[..., inverse].reshape(x.shape)


def dequantize_awq(t: dict) -> torch.Tensor:
    q = _awq_unorder(unpack_int32(t["qweight"], dim=1))  # [in, out]
    zeros = _awq_unorder(unpack_int32(t["qzeros"], dim=1))  # [groups, out]
    group = q.shape[0] // zeros.shape[0]
    return ((q - zeros.repeat_interleave(group, 0)) * t["scales"].float().repeat_interleave(group, 0)).T.contiguous()


def published_int4(fmt: str, t: dict):
    """(codes [out, in] uint8, scales [groups, out], zeros [groups, out]) of a GPTQ/AWQ linear whose groups are
    contiguous runs of input channels (what brrr's int4 kernel layout holds); None for act-order GPTQ."""
    if fmt == "awq":
        q = _awq_unorder(unpack_int32(t["qweight"], dim=1))
        zeros = _awq_unorder(unpack_int32(t["qzeros"], dim=1))
    else:
        q = unpack_int32(t["qweight"], dim=0)
        zeros = unpack_int32(t["qzeros"], dim=1) + (1 if fmt == "gptq" else 0)
        groups = t["scales"].shape[0]
        if q.shape[0] % groups or not torch.equal(t["g_idx"].long().cpu(),
                                                  torch.arange(q.shape[0]) // (q.shape[0] // groups)):
            return None
    return q.T.to(torch.uint8), t["scales"], zeros.to(torch.uint8)


def published_format(qc: dict, source: str) -> str:
    """brrr's format name for a published quantization_config, or a clear error for what brrr cannot read."""
    method = qc.get("quant_method")
    if qc.get("bits") != 4:
        raise BrrrError(f"{source}: quantization_config bits {qc.get('bits')!r}: brrr reads 4-bit {method} only")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise BrrrError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return "gptq_v2" if fmt == "gptq_v2" else "gptq"
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or qc.get("zero_point", True) is not True:
        raise BrrrError(f"{source}: AWQ version {version!r} zero_point {qc.get('zero_point')!r}: "
                        "brrr reads GEMM packing with zero points only")
    return "awq"
