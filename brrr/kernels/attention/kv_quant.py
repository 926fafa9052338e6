"""FP8 KV cache: one layer's (k, v) cache pair in float8 with a per-tensor scale each, and the quantize / dequantize
steps every cache write and read takes (vLLM's `--kv-cache-dtype fp8`).

A cached value is stored as fp8(clamp(x / scale, -max, max)) and read back as fp32(stored) * scale, cast to the
query's dtype: the saturating cast keeps an outlier at the format's largest finite value instead of inf (e5m2) or
NaN (e4m3fn). The scales are fp32 tensors of one element on the cache's device, so a CUDA graph reads them as it
reads the cache. They are 1.0 unless `pending`: then the first write into the layer (the first prefill) sets them
from its amax, once, and every later token, prefix hit and recomputed prefill uses the same scales.
"""
from __future__ import annotations

import torch

# vLLM's spellings; "fp8" is e4m3 (3 mantissa bits, range +-448), e5m2 trades a mantissa bit for range (+-57344)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8 = frozenset(KV_CACHE_DTYPES.values())


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for EngineConfig.kv_cache_dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


class QuantKV(tuple):
    """(k_cache, v_cache) of one layer, as every cache pair unpacks, plus their scales (k_scale, v_scale: fp32 [1])
    and whether those are still to be computed from the first write (pending)."""

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, pending: bool = False):
        pair = super().__new__(cls, (k_cache, v_cache))
        pair.k_scale = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        pair.v_scale = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        pair.pending = pending
        return pair

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_scale, self.v_scale


def kv_scales(pair) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache pair's (k_scale, v_scale), None for an unquantized one."""
    return pair.scales if isinstance(pair, QuantKV) else None


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def calibrate(pair, k: torch.Tensor, v: torch.Tensor) -> None:
    """The first write into a pending pair sets its scales from this write's amax (the largest value maps to the
    format's largest), on the device, without a host sync; later writes keep them."""
    if not isinstance(pair, QuantKV) or not pair.pending or k.shape[0] == 0:
        return
    top = fp8_max(pair[0].dtype)
    tiny = torch.finfo(torch.float32).tiny
    pair.k_scale.copy_((k.detach().abs().amax().float() / top).clamp_min(tiny).reshape(1))
    pair.v_scale.copy_((v.detach().abs().amax().float() / top).clamp_min(tiny).reshape(1))
    pair.pending = False


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the format's finite range, in fp8."""
    top = fp8_max(dtype)
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 x back to `dtype`: fp32(x) * scale, rounded once (as the kernels do in registers)."""
    return (x.float() * scale).to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as uint8: torch's CPU index_copy_ has no fp8 kernel; the bytes are the same."""
    return cache.view(torch.uint8) if cache.dtype in FP8 else cache
