"""An MoE block's quantized experts as the stacks the fused quantized-MoE kernel reads (`QuantExperts`,
brrr/kernels/fused_moe_quant.py): `brrr quantize` writes each expert projection as its own QuantLinear (the
checkpoint keeps the per-expert names), and serving (brrr/serving_form.py) stacks them once at load.

The stacks are QuantLinear's own codes and scales, re-laid: int8 [N, K] codes and per-row scales stacked over the
experts; int4 codes in the kernel layout by rows (QuantLinear keeps them `chunk_major`, the GEMV's layout), scales
and zero points [K/g, N] joined along N (gate rows, then up rows) and stacked. A symmetric expert's zero point is 8."""
from __future__ import annotations

import torch

from brrr.kernels.fused_moe_quant import QuantExperts
from brrr.quant.linear import QuantLinear


def _stack(mods: list[list[QuantLinear]]) -> QuantExperts:
    """mods[e]: expert e's projections, their outputs side by side (gate, up) -> one stack."""
    first = mods[0][0]
    if first.fmt == "int8":
        qweight = torch.stack([torch.cat([m.qweight.reshape(m.out_features, -1) for m in ms]) for ms in mods])
        scales = torch.stack([torch.cat([m.scales for m in ms]) for ms in mods])
        return QuantExperts(qweight, scales.float(), None, 0)
    qweight = torch.stack([torch.cat([m.qweight.reshape(m.out_features, -1) for m in ms]) for ms in mods])
    scales = torch.stack([torch.cat([m.scales for m in ms], dim=1) for ms in mods])
    zeros = None
    if any(m.zeros is not None for ms in mods for m in ms):
        zeros = torch.stack([torch.cat([torch.full_like(m.scales, 8, dtype=torch.uint8) if m.zeros is None
                                        else m.zeros for m in ms], dim=1) for ms in mods])
    return QuantExperts(qweight, scales.contiguous(), zeros, first.group_size)


def expert_stacks(experts) -> tuple[QuantExperts, QuantExperts] | None:
    """(gate_up [E, 2I, H], down [E, H, I]) of an MoE block's experts (GatedMLPs), or None unless every projection
    is a weight-only int8 QuantLinear, or every one int4 of one group size (the kernel's formats)."""
    projs = [e.projections() for e in experts]
    flat = [p for ps in projs for p in ps]
    first = flat[0]
    if not all(isinstance(p, QuantLinear) and p.activations is None and p.fmt in ("int8", "int4") for p in flat):
        return None
    if any(p.fmt != first.fmt or p.group_size != first.group_size for p in flat):
        return None
    return _stack([[g, u] for g, u, _ in projs]), _stack([[d] for _, _, d in projs])
