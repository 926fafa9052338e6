"""Quantize a loaded model in place: RTN (int8, int4, nf4, fp8), GPTQ and AWQ (int4 group-wise), SmoothQuant
(W8A8 int8) and FP8 W8A8.

Each method ends in `swap_linears`, so the model file never changes; the returned dict is the checkpoint's
`quantization_config` ("activations": "int8" | "fp8" marks the W8A8 methods, whose activations are quantized per
token at run time)."""
from __future__ import annotations

import logging

import torch

from brrr.errors import BrrrError
from brrr.progress import progress
from brrr.quant import formats
from brrr.quant.awq import fold, fold_groups, search_clip, search_scale
from brrr.quant.calib import layer_by_layer, record_inputs, recording
from brrr.quant.gptq import Hessian, gptq_quantize
from brrr.quant.linear import QuantLinear, projections, swap_linears
from brrr.quant.smoothquant import ALPHA, smooth_model

METHOD_FORMAT = {"rtn-int8": "int8", "rtn-int4": "int4", "gptq": "int4", "awq": "int4", "nf4": "nf4", "fp8": "fp8",
                 "smoothquant": "int8", "fp8-w8a8": "fp8"}
METHOD_ACTIVATIONS = {"smoothquant": "int8", "fp8-w8a8": "fp8"}
NEEDS_CALIBRATION = ("gptq", "awq", "smoothquant")
FOLDING = ("awq", "smoothquant")  # methods that fold per-channel scales into the layers (Llama's fold groups only)
# GPTQ's order within a layer; the projections of a group read one input
SEQUENTIAL = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
GATE_UP = ("gate_proj", "up_proj", "w1", "w3")  # an expert's projections that read the block's input
AWQ_TOKENS = 512  # calibration tokens kept per input for AWQ's searches (the reference's clip search uses 512)

log = logging.getLogger(__name__)


def quant_linear(fmt: str, linear, tensors: dict, activations: str | None = None) -> QuantLinear:
    device = linear.weight.device
    return QuantLinear(fmt, {k: v.to(device) for k, v in tensors.items()}, linear.in_features,
                       linear.out_features, linear.bias, dtype=linear.weight.dtype, activations=activations)


def rtn_tensors(fmt: str, w: torch.Tensor, group_size: int, symmetric: bool) -> dict:
    if fmt == "int8":
        return formats.quantize_int8(w)
    if fmt == "int4":
        return formats.quantize_int4(w, group_size, symmetric)
    if fmt == "nf4":
        return formats.quantize_nf4(w)
    return formats.quantize_fp8(w, per_row=True)


def quantize_model(model, method: str, group_size: int = 128, symmetric: bool = False,
                   calib: torch.Tensor | None = None, act_order: bool = True, lm_head: bool = False,
                   show_progress: bool = False) -> dict:
    """lm_head: also quantize the output projection, round-to-nearest in the method's format (as gpt-fast's int8 and
    int4 handlers do; GPTQ/AWQ checkpoints usually leave it in floating point). show_progress: a bar on stderr
    for GPTQ and AWQ (minutes on a large model)."""
    if method not in METHOD_FORMAT:
        raise BrrrError(f"--method must be one of {', '.join(METHOD_FORMAT)}; got {method!r}")
    fmt = METHOD_FORMAT[method]
    if lm_head and method in METHOD_ACTIVATIONS:
        raise BrrrError(f"--lm-head quantizes weights only; --method {method} also quantizes activations")
    if lm_head and model.config.tie_word_embeddings:
        raise BrrrError("--lm-head: this model's lm_head is tied to its embeddings (tie_word_embeddings), which "
                        "stay in floating point")
    if fmt == "int4":
        for name, linear in projections(model, lm_head):
            formats.check_group(linear.in_features, group_size)
    if method in FOLDING and model.config.num_experts:
        raise BrrrError(f"--method {method} folds scales into the producer of each projection's input (a norm), which "
                        f"in an MoE layer also feeds the router and every expert; {model.config.architecture} is "
                        f"an MoE model: use rtn-int8, rtn-int4 or gptq")
    if method in NEEDS_CALIBRATION and (calib is None or calib.numel() == 0):
        raise BrrrError(f"--method {method} needs calibration data: pass --calib DIR|FILE")
    if method == "gptq":
        _gptq(model, calib, group_size, symmetric, act_order, show_progress)  # swaps each layer in as it goes
    else:
        if method == "awq":
            tensors = _awq(model, calib, group_size, symmetric, show_progress)
        else:
            if method == "smoothquant":
                smooth_model(model, calib)  # then plain per-channel int8 of the smoothed weights
            tensors = {n: rtn_tensors(fmt, m.weight, group_size, symmetric) for n, m in projections(model)}
        act = METHOD_ACTIVATIONS.get(method)
        swap_linears(model, lambda name, linear: quant_linear(fmt, linear, tensors[name], act))
    if lm_head:
        head = rtn_tensors(fmt, model.lm_head.weight, group_size, symmetric)
        model.lm_head = quant_linear(fmt, model.lm_head, head)
    config = {"quant_method": "brrr", "method": method, "format": fmt}
    if lm_head:
        config["lm_head"] = True
    if method in METHOD_ACTIVATIONS:
        config["activations"] = METHOD_ACTIVATIONS[method]
    if method == "smoothquant":
        config["alpha"] = ALPHA
    if fmt == "int4":
        config.update(group_size=group_size, symmetric=symmetric)
    if method == "gptq":
        config["act_order"] = act_order
    return config


def _gptq(model, calib, group_size, symmetric, act_order, show_progress=False):
    """Layer by layer, as the reference: each layer's Hessians come from the calibration stream as the layers
    before it, already quantized, pass it on, so GPTQ also corrects the error they add. Within a layer, true
    sequential (AutoGPTQ's default): q/k/v, then o, gate/up, down, each group's inputs recorded with the groups
    before it already quantized; projections that read one input share one Hessian."""
    unseen = []
    with progress("gptq", len(projections(model)), show_progress) as advance:
        for i, layer, replay in layer_by_layer(model, calib):
            device = layer.input_layernorm.weight.device  # on a GPU the Hessians and the sweep stay there
            for group in gptq_groups([n for n, _ in projections(layer)]):
                hessian = Hessian(layer.get_submodule(group[0]).in_features, device)
                with recording(layer, lambda name, x: hessian.add(x), only={group[0]}, stop=True):
                    replay()
                if hessian.n == 0:
                    unseen += [f"model.layers.{i}.{n}" for n in group]
                swap_linears(layer, lambda name, linear: quant_linear("int4", linear, gptq_or_rtn(
                    linear.weight.detach(), hessian, group_size, symmetric, act_order)), only=set(group))
                advance(len(group))
    if unseen:
        log.info("gptq: %d expert projections saw no calibration tokens and were rounded to nearest: %s",
                 len(unseen), ", ".join(unseen))


def gptq_or_rtn(w, hessian: Hessian, group_size: int, symmetric: bool, act_order: bool) -> dict:
    """GPTQ of w over the Hessian, or round-to-nearest when no calibration token reached it (an MoE expert the
    router never picked): an empty Hessian makes every input dead, and GPTQ would zero the whole weight."""
    if hessian.n == 0:
        return formats.quantize_int4(w, group_size, symmetric)
    return gptq_quantize(w, hessian.H, group_size, symmetric, act_order)


def gptq_groups(names: list[str]) -> list[list[str]]:
    """A decoder layer's projections (names relative to it, in forward order) in GPTQ's order, those that read one
    input together: SEQUENTIAL, then each MoE expert's (and shared expert's) gate/up, then its down."""
    groups = [[n for n in g if n in names] for g in SEQUENTIAL]
    rest: dict[str, list[str]] = {}
    for n in names:
        if not any(n in g for g in groups):
            parent, _, leaf = n.rpartition(".")
            rest.setdefault(f"{parent}.gate_up" if leaf in GATE_UP else n, []).append(n)
    return [g for g in groups + list(rest.values()) if g]


def awq_inputs(model, calib) -> dict[str, torch.Tensor]:
    """Up to AWQ_TOKENS calibration inputs of each projection, spread over all the data, on the model's device (the
    searches run where the model is)."""
    inputs: dict[str, list] = {}
    stride = max(1, calib.numel() // (2 * AWQ_TOKENS))
    record_inputs(model, calib,
                  lambda name, x: inputs.setdefault(name, []).append(x.reshape(-1, x.shape[-1])[::stride].clone()))
    gen = torch.Generator().manual_seed(0)
    return {name: (x := torch.cat(chunks))[torch.randperm(len(x), generator=gen)[:AWQ_TOKENS]]
            for name, chunks in inputs.items()}


def fold_awq_scales(model, xs: dict, group_size: int, symmetric: bool, advance=lambda n=1: None):
    """Search each fold group's scales and fold them in (the float model's function is unchanged); `xs` is
    updated to the inputs the scaled projections now see."""
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for producer, consumers in fold_groups(layer, model.config):
            mods = [layer.get_submodule(c) for c in consumers]
            s = search_scale([m.weight for m in mods], xs[prefix + consumers[0]], group_size, symmetric)
            fold(s, producer, mods)
            for c in consumers:
                xs[prefix + c] = xs[prefix + c] / s
        advance()


def _awq(model, calib, group_size, symmetric, show_progress=False) -> dict:
    xs = awq_inputs(model, calib)
    names = projections(model)
    tensors = {}
    with progress("awq", len(model.model.layers) + len(names), show_progress) as advance:  # scales, then clips
        fold_awq_scales(model, xs, group_size, symmetric, advance)
        for name, linear in names:
            w = linear.weight.detach().float()
            clip = search_clip(w, xs[name], group_size, symmetric)
            tensors[name] = formats.quantize_int4(w, group_size, symmetric, clip)
            advance()
    return tensors
