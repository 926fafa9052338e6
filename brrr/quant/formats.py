"""Weight formats in plain torch: quantize a float weight [out, in] into stored tensors, and dequantize them back.

int8   per output channel, symmetric: w ~ q * scale, q in [-127, 127].
int4   per group of `group_size` input columns: asymmetric w ~ (q - zero) * scale, q, zero in [0, 15]; or symmetric
       (zero fixed at 8). Two nibbles per uint8 along the input dim (column 2j in the low nibble, 2j+1 in the high).
nf4    QLoRA's 16 normal-float levels, one absmax per block of 64 weights; double quantization stores the absmaxes
       as int8 (after subtracting their mean) with one float scale per block of 256 absmaxes.
fp8    float8_e4m3fn weights with a per-tensor or per-row float32 scale (448 = largest E4M3 value).
"""
from __future__ import annotations

import torch

from brrr.analysis.finetune import NF4_BLOCK, NF4_SCALE_BLOCK
from brrr.errors import BrrrError
from brrr.kernels.quant.layouts import int4_params, int4_round
from brrr.quant.published import dequantize_awq, dequantize_gptq, dequantize_gptq_v2

GROUP_SIZES = (32, 64, 128)
NF4_LEVELS = torch.tensor([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                           0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0])
FP8_MAX = 448.0


# ---- int8 per channel -------------------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> dict:
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scales": scale}


def dequantize_int8(t: dict) -> torch.Tensor:
    return t["qweight"].float() * t["scales"][:, None]


# ---- int4 group-wise ----------------------------------------------------------------------------------------------
def check_group(in_features: int, group_size: int):
    if group_size not in GROUP_SIZES:
        raise BrrrError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}; got {group_size}")
    if in_features % group_size:
        raise BrrrError(f"group_size {group_size} does not divide the input dimension {in_features}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[out, in] integers in [0, 15] -> [out, in/2] uint8."""
    if q.shape[-1] % 2:
        raise BrrrError(f"int4 packing needs an even input dimension; got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 -> [out, in] uint8 in [0, 15]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False, clip=1.0) -> dict:
    out, n = w.shape
    check_group(n, group_size)
    g = w.float().view(out, n // group_size, group_size)
    scale, zero = int4_params(g, symmetric, clip)
    q = int4_round(g, scale[..., None], zero[..., None]).view(out, n)
    return from_codes(q, scale, zero)


def from_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict:
    """Stored int4 tensors from codes [out, in] and per-group scale/zero [out, groups]."""
    return {"qweight": pack_int4(q), "scales": scale.float().contiguous(), "zeros": zero.to(torch.uint8).contiguous()}


def dequantize_int4(t: dict) -> torch.Tensor:
    q = unpack_int4(t["qweight"]).float()
    out, n = q.shape
    groups = t["scales"].shape[1]
    q = q.view(out, groups, n // groups)
    return ((q - t["zeros"].float()[..., None]) * t["scales"][..., None]).view(out, n)


# ---- NF4 with double quantization -------------------------------------------------------------------------------
_NF4_ON: dict = {}


def _nf4_levels(device) -> torch.Tensor:
    """NF4_LEVELS on `device`, copied once (the first dequantize runs eagerly; a copy from the CPU inside a
    CUDA-graph capture would fail)."""
    if device not in _NF4_ON:
        _NF4_ON[device] = NF4_LEVELS.to(device)
    return _NF4_ON[device]

def quantize_nf4(w: torch.Tensor) -> dict:
    flat = w.float().flatten()
    if flat.numel() % NF4_BLOCK:
        raise BrrrError(f"nf4 needs a weight size divisible by {NF4_BLOCK}; got {tuple(w.shape)}")
    blocks = flat.view(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp(min=1e-12)
    levels = _nf4_levels(blocks.device)
    # nearest level, in slices: the [blocks, 64, 16] distances of a whole 8B-model projection would take ~4 GB
    codes = torch.cat([(b / a[:, None])[..., None].sub(levels).abs().argmin(dim=-1).to(torch.uint8)
                       for b, a in zip(blocks.split(1 << 14), absmax.split(1 << 14))])
    # double quantization of the absmaxes: int8 around their mean, one scale per 256
    mean = absmax.mean()
    centered = absmax - mean
    pad = (-centered.numel()) % NF4_SCALE_BLOCK
    padded = torch.cat([centered, centered.new_zeros(pad)]).view(-1, NF4_SCALE_BLOCK)
    scale2 = (padded.abs().amax(dim=1) / 127).clamp(min=1e-12)
    absmax_q = torch.round(padded / scale2[:, None]).clamp(-127, 127).to(torch.int8).flatten()[:absmax.numel()]
    return {"qweight": pack_int4(codes.view(1, -1)).flatten(), "absmax_q": absmax_q, "absmax_scales": scale2,
            "absmax_mean": mean.reshape(1), "shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def dequantize_nf4(t: dict) -> torch.Tensor:
    codes = unpack_int4(t["qweight"].view(1, -1)).flatten().long()
    n = t["absmax_q"].numel()
    scale2 = t["absmax_scales"].repeat_interleave(NF4_SCALE_BLOCK)[:n]
    absmax = t["absmax_q"].float() * scale2 + t["absmax_mean"]
    w = _nf4_levels(codes.device)[codes].view(-1, NF4_BLOCK) * absmax[:, None]
    return w.view(*t["shape"].tolist())


# ---- FP8 E4M3 -----------------------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, per_row: bool = True) -> dict:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return {"qweight": (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "scales": scale.flatten()}


def dequantize_fp8(t: dict) -> torch.Tensor:
    s = t["scales"]
    return t["qweight"].float() * (s[:, None] if s.numel() > 1 else s)


def _published():
    return {"gptq": dequantize_gptq, "gptq_v2": dequantize_gptq_v2, "awq": dequantize_awq}


DEQUANTIZE = {"int8": dequantize_int8, "int4": dequantize_int4, "nf4": dequantize_nf4, "fp8": dequantize_fp8,
              **_published()}


def bits_per_weight(fmt: str, tensors: dict, numel: int) -> float:
    """Stored bits per weight, metadata (scales, zeros, absmaxes) included."""
    return sum(t.numel() * t.element_size() * 8 for k, t in tensors.items() if k != "shape") / numel
