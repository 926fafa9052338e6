"""Ops the models call. Each file holds `<op>_ref` (plain torch, the oracle) and `<op>()`, the dispatcher
that later picks a Triton kernel on CUDA."""
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.attention import AttnMeta, attention
from brrr.kernels.rms_norm import rms_norm
from brrr.kernels.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin

__all__ = ["AttnMeta", "attention", "apply_rotary", "rms_norm", "rope_inv_freq", "rotary_cos_sin", "silu_and_mul"]
