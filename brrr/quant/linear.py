"""QuantLinear: the one seam through which quant/ replaces nn.Linear.

It takes a format's tensors as a checkpoint stores them and keeps them in the layout its matmul reads:
  int4 (and 4-bit GPTQ/AWQ without act-order): the kernel layout of brrr/kernels/quant/layouts.py (codes packed per
       group half, stored `chunk_major`; scales and zeros [K/g, N]); forward = `w4a16_matmul` (Triton on CUDA,
       torch reference elsewhere)
  int8: stored `chunk_major` for `w8a16_matmul`, or as stored with activations="int8" (SmoothQuant W8A8) per-token int8
       activations through `torch._int_mm` (brrr/quant/w8a8.py)
  fp8: weight-only stored `chunk_major` with a scale per row for the W8A16 kernels (which convert E4M3 bytes where
       they convert int8 ones), or as stored with activations="fp8" (FP8 W8A8): `torch._scaled_mm`
  q8_0, q4_k, q5_k, q6_k: GGUF blocks repacked exactly (brrr/gguf/repack.py) into the group-wise layouts of
       brrr/kernels/quant/groupwise.py, every tensor [N, ...] by rows; forward = `groupwise_matmul` (Triton on CUDA,
       torch reference elsewhere)
  nf4, act-order GPTQ: as stored; forward dequantizes the weight in torch (correct, not fast).
`state_dict()` gives the checkpoint format back, so `save_quantized` writes what the loader reads.

The model file is untouched: `swap_linears` replaces the decoder layers' projections (HF names q_proj ... down_proj)
after load; embeddings and norms stay in floating point, and lm_head too unless `brrr quantize --lm-head`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brrr.kernels.activation import silu_and_mul
from brrr.kernels.quant import (GROUPWISE_GROUPS, chunk_major, dequantize_groupwise, dequantize_w4, groupwise_matmul,
                                pack_int4_kernel, unpack_int4_kernel, w4a16_gated_matmul, w4a16_matmul,
                                w8a16_gated_matmul, w8a16_matmul, with_norm_and_residual)
from brrr.kernels.rms_norm import PendingNorm
from brrr.quant.formats import DEQUANTIZE, pack_int4, unpack_int4
from brrr.quant.published import published_int4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # Mixtral's experts' gate, up, down (the others' use the names above)
ACTIVATIONS = {"int8": "int8", "fp8": "fp8"}  # activation mode -> the weight format it needs


class QuantLinear(nn.Module):
    release_early = False  # set on packed q/k/v (serving_form.py): decode attention may start at the last K step

    def __init__(self, fmt: str, tensors: dict, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32, activations: str | None = None):
        super().__init__()
        self.fmt, self.in_features, self.out_features, self.activations = fmt, in_features, out_features, activations
        # stored bits of the checkpoint's tensors (what `brrr eval compare` reports), metadata included
        self.stored_bits = sum(t.numel() * t.element_size() * 8 for k, t in tensors.items() if k != "shape")
        self.group_size = 0
        int4 = _int4_codes(fmt, tensors)
        if int4 is not None:
            codes, scales, zeros = int4  # codes [N, K], scales/zeros [K/g, N]
            self.fmt, self.group_size = "int4", in_features // scales.shape[0]
            symmetric = bool((zeros == 8).all())
            # bf16 models keep bf16 scales (what the kernel's bf16 dequant multiplies by); others fp32
            kernel = {"qweight": chunk_major(pack_int4_kernel(codes, self.group_size)),
                      "scales": scales.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32).contiguous(),
                      "zeros": None if symmetric else zeros.to(torch.uint8).contiguous()}
        else:
            kernel = dict(tensors)
            if fmt in ("int8", "fp8") and activations is None:  # weight-only: the W8A16 kernels' layout
                kernel["qweight"] = chunk_major(kernel["qweight"])
                kernel["scales"] = kernel["scales"].float().expand(out_features).contiguous()  # fp8 per tensor: [1]
        self.tensor_names = tuple(kernel)
        for name, t in kernel.items():
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def concat(cls, mods: list["QuantLinear"]) -> "QuantLinear | None":
        """One QuantLinear computing the given ones side by side (their outputs concatenated), for packed q/k/v
        and gate/up GEMMs; None when they cannot be joined (different formats, nf4, act-order GPTQ). GGUF types
        differ in group, code width and scale tensors, so a Q4_K_M file's Q4_K q/k beside its Q6_K v have no joint
        layout: None, and prepare_for_serving keeps those three unpacked (each its own exact GEMV)."""
        first = mods[0]
        same = all(m.fmt == first.fmt and m.activations == first.activations and m.group_size == first.group_size
                   and m.in_features == first.in_features and (m.bias is None) == (first.bias is None) for m in mods)
        if not same or first.fmt not in ("int4", "int8", "fp8", *GROUPWISE_GROUPS):
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.fmt, new.in_features, new.activations = first.fmt, first.in_features, first.activations
        new.out_features, new.group_size = sum(m.out_features for m in mods), first.group_size
        new.stored_bits, new.tensor_names = sum(m.stored_bits for m in mods), first.tensor_names
        if first.fmt == "int4":  # qweight joined along N, kept chunk-major; scales, zeros [K/g, N] by columns
            zeros = None
            if any(m.zeros is not None for m in mods):
                zeros = torch.cat([torch.full_like(m.scales, 8, dtype=torch.uint8) if m.zeros is None else m.zeros
                                   for m in mods], dim=1)
            tensors = {"qweight": chunk_major(torch.cat([m.qweight for m in mods])),
                       "scales": torch.cat([m.scales for m in mods], dim=1), "zeros": zeros}
        elif first.fmt in GROUPWISE_GROUPS:  # every tensor [N, ...] by rows, groups along K: joined by rows
            tensors = {name: torch.cat([getattr(m, name) for m in mods]) for name in first.tensor_names}
        else:  # qweight [N, K] (chunk-major for weight-only int8), scales [N] (an fp8 per-tensor [1] repeats per row)
            qweight = torch.cat([m.qweight for m in mods])
            tensors = {"qweight": chunk_major(qweight) if qweight.dim() == 3 else qweight,
                       "scales": torch.cat([m.scales.expand(m.out_features) for m in mods])}
        for name, t in tensors.items():
            new.register_buffer(name, t)
        new.bias = None if first.bias is None else nn.Parameter(torch.cat([m.bias for m in mods]),
                                                                 requires_grad=False)
        return new

    def tensors(self) -> dict:
        """The in-memory (kernel-layout) tensors."""
        return {name: getattr(self, name) for name in self.tensor_names}

    def checkpoint_tensors(self) -> dict:
        """The tensors in the checkpoint format of `self.fmt` (formats.py)."""
        if self.fmt != "int4":
            tensors = self.tensors()
            if tensors["qweight"].dim() == 3:  # chunk-major int8 -> [N, K] by rows
                tensors["qweight"] = tensors["qweight"].reshape(self.out_features, -1)
            return tensors
        codes = unpack_int4_kernel(self.qweight, self.group_size)
        zeros = torch.full_like(self.scales, 8, dtype=torch.uint8) if self.zeros is None else self.zeros
        return {"qweight": pack_int4(codes), "scales": self.scales.t().float().contiguous(),
                "zeros": zeros.t().contiguous()}

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        if self.fmt == "int4":
            return dequantize_w4(self.qweight, self.scales, self.zeros, self.group_size)
        if self.fmt in GROUPWISE_GROUPS:
            return dequantize_groupwise(self.fmt, **self.tensors())
        tensors = self.checkpoint_tensors()
        if "shape" in tensors:  # known on the host: reading the stored one from the GPU would sync (and break capture)
            tensors["shape"] = torch.tensor([self.out_features, self.in_features])
        return DEQUANTIZE[self.fmt](tensors)

    @property
    def takes_norms(self) -> bool:
        """Batch-1 decode runs the RMSNorm before it and the residual add after it inside its MMA GEMV (`forward`;
        brrr/serving_form.py's GemvNormLlamaForCausalLM where every projection does): int4 g128. The int8 and FP8
        kernels take them too, but their decode step was slower that way (docs/quantization.md)."""
        return self.activations is None and self.fmt == "int4" and self.group_size == 128

    def forward(self, x, residual=None, next_norm=None, out_dtype=None):
        """x @ W^T (+ bias). x may be a PendingNorm (brrr/kernels/rms_norm.py): then of the normed rows. residual
        (next_norm: the next RMSNorm's (weight, eps)): (h = y + residual, h's PendingNorm). Both inside the MMA
        GEMV where `takes_norms` and one row, else in torch around the GEMM (`with_norm_and_residual`). out_dtype
        (no residual): y in that dtype, its values those of x's (weight-only: stored so by the MMA GEMV)."""
        bias = None if self.bias is None else self.bias.to(PendingNorm.rows(x).dtype)
        if self.fmt == "int4" and self.activations is None:
            return w4a16_matmul(x, self.qweight, self.scales, self.zeros, self.group_size, bias, self.release_early,
                                residual, next_norm, out_dtype)
        if self.fmt in ("int8", "fp8") and self.activations is None:
            return w8a16_matmul(x, self.qweight, self.scales, bias, self.release_early, residual, next_norm, out_dtype)
        y = with_norm_and_residual(lambda x: self._matmul(x, bias), x, residual, next_norm)
        return y if out_dtype is None else y.to(out_dtype)

    def _matmul(self, x, bias):
        if self.activations is not None:
            # W8A8 only: its per-token activation kernels load with the first such layer, not with every model
            from brrr.quant.w8a8 import fp8_w8a8_linear, int8_w8a8_linear

            run = int8_w8a8_linear if self.activations == "int8" else fp8_w8a8_linear
            return run(x, self.qweight, self.scales, bias)
        if self.fmt in GROUPWISE_GROUPS:
            return groupwise_matmul(x, self.fmt, **self.tensors(), bias=bias)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def gated(self, x):
        """silu(gate) * up of a packed gate/up projection (outputs: gate, then up; brrr/serving_form.GatedGemvMLP):
        weight-only int8/int4 in one kernel at batch-1 decode (`w8a16_gated_matmul`), else forward then
        silu_and_mul."""
        bias = None if self.bias is None else self.bias.to(PendingNorm.rows(x).dtype)
        if self.activations is None and self.fmt == "int4":
            return w4a16_gated_matmul(x, self.qweight, self.scales, self.zeros, self.group_size, bias)
        if self.activations is None and self.fmt in ("int8", "fp8"):
            return w8a16_gated_matmul(x, self.qweight, self.scales, bias)
        return silu_and_mul(*self.forward(x).chunk(2, -1))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self.checkpoint_tensors().items():
            destination[prefix + name] = t if keep_vars else t.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self):
        act = f", activations={self.activations}" if self.activations else ""
        group = f", group_size={self.group_size}" if self.fmt == "int4" else ""
        return f"fmt={self.fmt}{group}{act}, in_features={self.in_features}, out_features={self.out_features}"


def _int4_codes(fmt: str, tensors: dict):
    """(codes [N, K], scales [K/g, N], zeros [K/g, N]) for int4-style formats the kernel can run, else None."""
    if fmt == "int4":
        return unpack_int4(tensors["qweight"]), tensors["scales"].t(), tensors["zeros"].t()
    if fmt in ("gptq", "gptq_v2", "awq"):
        return published_int4(fmt, tensors)  # None for act-order GPTQ (groups not contiguous)
    return None


def is_projection(name: str) -> bool:
    """A decoder-layer projection by its qualified name: attention's, a dense MLP's, a routed or shared expert's.
    MoE routers (`mlp.gate`, Qwen2-MoE's `shared_expert_gate`) are not: they stay in floating point."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in PROJECTIONS or (leaf in EXPERT_PROJECTIONS and ".experts." in name)


def projections(model, lm_head: bool = False) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every decoder-layer projection, in forward order; lm_head last if asked."""
    mods = [(n, m) for n, m in model.named_modules() if is_projection(n)]
    return mods + [("lm_head", model.lm_head)] if lm_head else mods


def swap_linears(model, make, only=None) -> dict[str, QuantLinear]:
    """Replace each projection `name` (those in `only`, if given) with make(name, linear) -> QuantLinear. Returns
    the new modules by name."""
    swapped = {}
    for name, linear in projections(model):
        if only is not None and name not in only:
            continue
        parent, _, attr = name.rpartition(".")
        q = make(name, linear)
        setattr(model.get_submodule(parent), attr, q)
        swapped[name] = q
    return swapped
