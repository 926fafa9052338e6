"""SmoothQuant (Xiao et al. 2023): activations have a few input channels with outliers far above the rest, which
per-token int8 rounds badly; weights are flat. Migrate part of the range from activations to weights per input
channel j: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (alpha 0.5), divide the producer's output channel j by s_j
(an RMSNorm weight, or the rows of v_proj / up_proj) and multiply the consumers' input column j by s_j. The float
model computes the same function; then the weights are int8 per output channel and the activations int8 per token
at run time (brrr/quant/w8a8.py).

The fold groups are AWQ's (awq.fold_groups): input_layernorm -> q/k/v, v_proj -> o_proj when there is no GQA,
post_attention_layernorm -> gate/up, up_proj -> down_proj (where the SwiGLU product's outliers live). max|X_j| is
measured once, on the float model; every fold preserves the function, so the statistics stay valid."""
from __future__ import annotations

import torch

from brrr.quant.awq import fold, fold_groups
from brrr.quant.calib import record_inputs

ALPHA = 0.5


@torch.no_grad()
def activation_absmax(model, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens, per projection and input channel (float32, CPU)."""
    amax: dict[str, torch.Tensor] = {}

    def on_input(name, x):
        m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).cpu()
        amax[name] = torch.maximum(amax[name], m) if name in amax else m

    record_inputs(model, calib, on_input)
    return amax


def smooth_scales(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = ALPHA) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), the weight max over every consumer's column j."""
    w_absmax = torch.cat([w.float().abs() for w in weights]).amax(dim=0)
    s = x_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_model(model, calib: torch.Tensor, alpha: float = ALPHA):
    """Fold the smoothing scales into the model in place (the float model's outputs are unchanged)."""
    amax = activation_absmax(model, calib)
    for i, layer in enumerate(model.model.layers):
        for producer, consumers in fold_groups(layer, model.config):
            mods = [layer.get_submodule(c) for c in consumers]
            s = smooth_scales(amax[f"model.layers.{i}.{consumers[0]}"], [m.weight.cpu() for m in mods], alpha)
            fold(s.to(mods[0].weight.device), producer, mods)
