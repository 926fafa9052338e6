"""QLoRA's frozen base: every projection stored in brrr's NF4 format with double quantization (a `QuantLinear` of
format nf4, brrr/quant), loaded one tensor at a time so the model never exists in full precision on the GPU.

`nf4_linear` is the base's matmul in training: the weight is dequantized to the compute dtype by the Triton kernel
(brrr/quant/nf4_kernel.py) in forward, dropped, and dequantized again in backward for the input gradient; the
weight itself gets no gradient (it is frozen), so backward is one matmul with the dequantized W.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.loader import weight_files
from brrr.models import model_class
from brrr.quant.nf4_kernel import dequantize_nf4_weight
from brrr.quant.formats import quantize_nf4
from brrr.quant.linear import PROJECTIONS, QuantLinear


def nf4_weight(base: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_nf4_weight(base.tensors(), (base.out_features, base.in_features), dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _NF4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base: QuantLinear):
        ctx.base = base
        return x @ nf4_weight(base, x.dtype).t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ nf4_weight(ctx.base, grad.dtype), None


def nf4_linear(x: torch.Tensor, base: QuantLinear) -> torch.Tensor:
    """x @ W^T (+ bias) with W the NF4 base weight, differentiable in x only."""
    x = x.to(_compute_dtype(x))
    with torch.autocast(x.device.type, enabled=False):
        y = _NF4Matmul.apply(x, base)
    return y if base.bias is None else y + base.bias.to(y.dtype)


def nf4_quant_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantLinear:
    out_f, in_f = weight.shape
    return QuantLinear("nf4", quantize_nf4(weight), in_f, out_f, bias, dtype)


def build_nf4_model(cfg: ModelConfig, tensor: Callable[[str, tuple], torch.Tensor], device,
                    dtype: torch.dtype) -> nn.Module:
    """A model whose projections are NF4 QuantLinears and whose other parameters (embeddings, norms, lm_head) are in
    `dtype`, all on `device`, filled by tensor(name, shape) one at a time: each projection's weight is quantized on
    the device right after it arrives and freed, so the peak is the quantized model plus one full weight."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    for name, module in list(model.named_modules()):
        for attr, p in list(module._parameters.items()):
            if p is None or (cfg.tie_word_embeddings and name == "lm_head"):
                continue
            full = f"{name}.{attr}" if name else attr
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                continue  # below, weight and bias together
            module._parameters[attr] = nn.Parameter(tensor(full, tuple(p.shape)).to(device, dtype),
                                                    requires_grad=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, linear in [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]:
        weight = tensor(f"{name}.weight", tuple(linear.weight.shape)).to(device)
        bias = None if linear.bias is None else tensor(f"{name}.bias", tuple(linear.bias.shape)).to(device, dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nf4_quant_linear(weight, bias, dtype))
        del weight
    return model.requires_grad_(False)


def load_nf4_model(path, device, dtype: torch.dtype) -> nn.Module:
    """An HF model directory's Llama-family model with NF4 projections (build_nf4_model over its safetensors)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    where: dict[str, Path] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                where[key] = file
    if not cfg.runnable or cfg.num_experts or cfg.kv_lora_rank:  # NF4 builds dense Llama-family layers only
        raise BrrrError(f"{path}: brrr cannot QLoRA-fine-tune a {cfg.architecture} (dense Llama-family models only)")

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        if name not in where:
            raise BrrrError(f"checkpoint in {path} is missing tensor {name!r}")
        with safe_open(str(where[name]), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if tuple(t.shape) != shape:
            raise BrrrError(f"{where[name]}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
        return t

    return build_nf4_model(cfg, tensor, device, dtype).eval()


def random_nf4_model(cfg: ModelConfig, device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """build_nf4_model with brrr.models.random_weights's values (N(0, 0.02) matrices, unit norms, zero biases): the
    benchmark's 8B-shape QLoRA base without an 8B full-precision copy."""
    gen = torch.Generator(device).manual_seed(seed)

    def tensor(name: str, shape: tuple) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(shape, device=device, dtype=dtype)
        if name.endswith("bias"):
            return torch.zeros(shape, device=device, dtype=dtype)
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)

    return build_nf4_model(cfg, tensor, device, dtype).eval()
