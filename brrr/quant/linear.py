"""QuantLinear: the one seam through which quant/ replaces nn.Linear. It stores a format's tensors as buffers and
its reference forward dequantizes them in torch (Triton W4A16/W8A16 kernels are the next step behind this seam).

The model file is untouched: `swap_linears` replaces the decoder layers' projections (HF names q_proj ... down_proj)
after load; embeddings, norms and lm_head stay in floating point."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brrr.quant.formats import DEQUANTIZE

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class QuantLinear(nn.Module):
    def __init__(self, fmt: str, tensors: dict, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def tensors(self) -> dict:
        return {name: getattr(self, name) for name in self.tensor_names}

    def dequantize(self) -> torch.Tensor:
        return DEQUANTIZE[self.fmt](self.tensors())

    def forward(self, x):
        return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self):
        return f"fmt={self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def projections(model) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every decoder-layer projection, in forward order."""
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]


def swap_linears(model, make) -> dict[str, QuantLinear]:
    """Replace each projection `name` with make(name, linear) -> QuantLinear. Returns the new modules by name."""
    swapped = {}
    for name, linear in projections(model):
        parent, _, attr = name.rpartition(".")
        q = make(name, linear)
        setattr(model.get_submodule(parent), attr, q)
        swapped[name] = q
    return swapped
