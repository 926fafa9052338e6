"""A GGUF file -> a brrr model: the config from its metadata, each tensor under its HF name, read from the
memory map once.

Where brrr has a weight-only module that holds a block type exactly, the projection keeps its codes: Q4_0 (32
weights, one fp16 scale d, w = d (q - 8)) is brrr's symmetric int4 with group size 32, so it is repacked into an
int4 QuantLinear (codes re-laid for the W4A16 kernels, scales d widened to fp32, no float copy of the weight);
Q8_0, Q4_K, Q5_K and Q6_K are repacked (repack.py) into the group-wise QuantLinear formats q8_0 / q4_k / q5_k /
q6_k, which keep the file's fp16 d / dmin and integer sub-block scales and run brrr/kernels/quant/groupwise.py.
Rows are whole blocks (the reader refuses a tensor whose row is not), so every such tensor fits its layout.
The other types (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K), and every non-projection tensor (embeddings, lm_head, norms), are
dequantized (dequant.py) into the model's dtype. The load logs (logger "brrr.gguf") which projections took the
dequantized path and why."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.gguf.config import hf_config
from brrr.gguf.dequant import SUPPORTED, dequantize
from brrr.gguf.names import hf_name, permuted_heads, row_order
from brrr.gguf.reader import GGUFFile, open_gguf
from brrr.gguf.repack import REPACKABLE, repack_groupwise
from brrr.models import model_class
from brrr.quant.formats import pack_int4
from brrr.quant.linear import PROJECTIONS, QuantLinear

log = logging.getLogger("brrr.gguf")
REPACKED = {T.Q4_0: "int4", **REPACKABLE}  # block type -> the QuantLinear format that holds it exactly


def gguf_config(f: GGUFFile) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(f), source=str(f.path))


def q4_0_int4(blocks: torch.Tensor, rows: int, cols: int) -> dict:
    """Q4_0 blocks [rows, cols / 32 * 18] -> brrr's int4 tensors (codes packed two per byte, scales [rows, groups],
    zeros 8): the same weights, w = d (q - 8)."""
    b = blocks.reshape(rows, cols // 32, 18)
    d = b[..., :2].contiguous().view(torch.float16).float().reshape(rows, cols // 32)
    qs = b[..., 2:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, cols)  # a block's low nibbles come first
    return {"qweight": pack_int4(codes), "scales": d, "zeros": torch.full_like(d, 8, dtype=torch.uint8)}


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device, repack: bool = True):
    """The model a GGUF file holds, in `dtype` on `device`. repack: keep the projections of the REPACKED types as
    QuantLinear (off: every quantized projection dequantized, the reference the repacked model is tested against)."""
    f = open_gguf(path)
    cfg = gguf_config(f)
    if not cfg.runnable:
        raise BrrrError(f"{path}: architecture {cfg.architecture} is not runnable in brrr")
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    filled, fallback = set(), []
    arch = f.architecture
    for name, t in f.tensors.items():
        hf = hf_name(name)
        if hf is None:
            continue
        if t.type not in SUPPORTED:
            raise BrrrError(f"{path}: tensor {name!r} has type {t.type.name}; brrr reads "
                            f"{', '.join(q.name for q in SUPPORTED)}")
        module_name, _, leaf = hf.rpartition(".")
        try:
            target = model.checkpoint_target(hf)
        except AttributeError:
            raise BrrrError(f"{path}: tensor {name!r} ({hf}) does not belong to a {cfg.architecture}") from None
        if target is None:
            continue
        if tuple(target.shape) != t.shape:
            raise BrrrError(f"{path}: tensor {name!r} has shape {t.shape}, the metadata implies {tuple(target.shape)}")
        data = torch.from_numpy(t.data).to(device)  # the blocks go over once; they expand where they will live
        heads = permuted_heads(arch, hf, cfg.num_heads, cfg.num_kv_heads)
        if heads is not None:  # rows are whole blocks: reorder them before anything reads the values
            data = data.reshape(t.shape[0], -1)[row_order(t.shape[0], heads).to(device)]
        is_projection = leaf == "weight" and module_name.rsplit(".", 1)[-1] in PROJECTIONS and len(t.shape) == 2
        if is_projection and repack and t.type in REPACKED:
            linear, blocks = model.get_submodule(module_name), data.reshape(t.shape[0], -1)
            fmt, tensors = (("int4", q4_0_int4(blocks, *t.shape)) if t.type == T.Q4_0
                            else repack_groupwise(blocks, t.type, *t.shape))
            q = QuantLinear(fmt, tensors, linear.in_features, linear.out_features, linear.bias, dtype=dtype)
            parent, _, attr = module_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, q)
            filled.add(hf)
            continue
        if is_projection and t.type not in (T.F32, T.F16, T.BF16):
            fallback.append(f"{name} ({t.type.name})")
        target.data.copy_(dequantize(data, t.type, t.shape))
        filled.add(hf)
    if fallback:
        why = "no exact brrr module for their type" if repack else "repack=False"
        log.info("%s: %d quantized projections dequantized to %s (%s): %s", path, len(fallback),
                 str(dtype).removeprefix("torch."), why, ", ".join(fallback))
    missing = sorted(n for n, _ in model.checkpoint_tensors() if n not in filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise BrrrError(f"{path} is missing tensors: {shown}")
    model.requires_grad_(False).eval()
    model.gguf_fallback = tuple(fallback)
    return model

