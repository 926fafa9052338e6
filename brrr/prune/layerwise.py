"""Prune a loaded model in place, one decoder layer at a time, as the Wanda and SparseGPT papers do: each layer's
statistics come from the calibration stream as the layers before it, already pruned, pass it on, so a layer sees
the inputs it will see after pruning. Within a layer the projections go in GPTQ's true-sequential order (q/k/v,
o, gate/up, down; brrr.quant.methods.SEQUENTIAL), each group's inputs recorded with the groups before it pruned;
projections that read one input share its statistics (the Hessian for SparseGPT, the column norms for Wanda).

The returned dict is the checkpoint's `sparsity_config` (named after compressed-tensors' fields: the weights stay
dense, `sparsity_structure` says the pattern, `global_sparsity` the measured fraction of zeros over the pruned
projections)."""
from __future__ import annotations

import torch

from brrr.errors import BrrrError
from brrr.progress import progress
from brrr.prune.magnitude import magnitude_prune
from brrr.prune.mask import Pattern, sparsity
from brrr.prune.sparsegpt import sparsegpt_prune
from brrr.prune.wanda import InputNorms, wanda_prune
from brrr.quant.calib import layer_by_layer, recording
from brrr.quant.gptq import Hessian
from brrr.quant.linear import PROJECTIONS, projections
from brrr.quant.methods import SEQUENTIAL

METHODS = ("magnitude", "wanda", "sparsegpt")
NEEDS_CALIBRATION = ("wanda", "sparsegpt")


def prune_model(model, method: str, pattern: Pattern, calib: torch.Tensor | None = None,
                show_progress: bool = False) -> dict:
    """calib [n, seq_len] token ids (wanda, sparsegpt). show_progress: a bar on stderr, one step per projection."""
    if method not in METHODS:
        raise BrrrError(f"--method must be one of {', '.join(METHODS)}; got {method!r}")
    if method in NEEDS_CALIBRATION and (calib is None or calib.numel() == 0):
        raise BrrrError(f"--method {method} needs calibration data: pass --calib DIR|FILE")
    for name, linear in projections(model):
        if not isinstance(linear, torch.nn.Linear):
            raise BrrrError(f"{name} is a {type(linear).__name__}: brrr prunes floating-point projections; prune "
                            "the unquantized model, then quantize it")
        pattern.check(name, linear.in_features)
    with progress(f"prune {method}", len(projections(model)), show_progress) as advance:
        if method == "magnitude":
            for _, linear in projections(model):
                _set(linear, magnitude_prune(linear.weight.detach(), pattern))
                advance()
        else:
            _calibrated(model, method, pattern, calib, advance)
    return sparsity_config(model, method, pattern)


def _calibrated(model, method, pattern, calib, advance):
    for _, layer, replay in layer_by_layer(model, calib):
        names = [n for n, _ in projections(layer)]
        groups = [[n for n in g if n in names] for g in SEQUENTIAL]
        groups += [[n] for n in names if not any(n in g for g in groups)]
        device = layer.input_layernorm.weight.device
        for group in filter(None, groups):
            dim = layer.get_submodule(group[0]).in_features
            stats = Hessian(dim, device) if method == "sparsegpt" else InputNorms(dim, device)
            with recording(layer, lambda name, x: stats.add(x), only={group[0]}, stop=True):
                replay()
            for name in group:
                linear = layer.get_submodule(name)
                w = linear.weight.detach()
                _set(linear, sparsegpt_prune(w, stats.H, pattern) if method == "sparsegpt"
                     else wanda_prune(w, stats.norms(), pattern))
                advance()


@torch.no_grad()
def _set(linear, w: torch.Tensor):
    linear.weight.copy_(w)


def projection_sparsity(model) -> float:
    """The fraction of exact zeros over the decoder projections' weights (float ones; others are skipped)."""
    zeros = total = 0
    for _, m in projections(model):
        if isinstance(m, torch.nn.Linear):
            zeros += (m.weight == 0).sum().item()
            total += m.weight.numel()
    return zeros / total if total else 0.0


def sparsity_config(model, method: str, pattern: Pattern) -> dict:
    per_row = [sparsity(m.weight) for _, m in projections(model)]
    return {"format": "dense", "sparsity_structure": pattern.name(), "method": method,
            "requested_sparsity": pattern.sparsity, "global_sparsity": projection_sparsity(model),
            "min_projection_sparsity": min(per_row), "targets": list(PROJECTIONS), "ignore": ["lm_head"]}
