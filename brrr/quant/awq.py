"""AWQ (Lin et al. 2023): protect the input channels that see large activations by scaling them up before
quantization, s = mean|x|^alpha (alpha searched on a grid), and folding 1/s into whatever produces the input (an
RMSNorm's weight or the previous linear's output rows), so the float model computes exactly the same function.
Then a per-group clipping search shrinks each group's range where that lowers the output error.

The loss for both searches is the MSE of the outputs of the linears that share the input (brrr's simplification:
the reference measures the whole attention/MLP block's output)."""
from __future__ import annotations

import torch

from brrr.quant.formats import dequantize_int4, quantize_int4

ALPHAS = [i / 20 for i in range(20)]  # 0, 0.05, ..., 0.95
CLIP_RATIOS = torch.linspace(1.0, 0.55, 10).tolist()


def fake_int4(w, group_size, symmetric, clip=1.0):
    return dequantize_int4(quantize_int4(w, group_size, symmetric, clip))


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], x: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """Per-input-channel scale s minimizing ||x W^T - (x/s) Q(W s)^T||^2 over the alpha grid."""
    W = torch.cat([w.float() for w in weights])
    ref = x @ W.T
    s_x = x.abs().mean(dim=0)
    best, best_s = float("inf"), torch.ones_like(s_x)
    for alpha in ALPHAS:
        s = s_x.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = ((x / s) @ fake_int4(W * s, group_size, symmetric).T - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """[out, groups] range shrink factors minimizing each group's contribution to the output error."""
    out, n = w.shape
    groups = n // group_size
    wg = w.float().view(out, groups, group_size)
    xg = x.view(-1, groups, group_size)  # [tokens, groups, g]
    best_err = torch.full((out, groups), float("inf"), device=w.device)
    best = torch.ones(out, groups, device=w.device)
    for ratio in CLIP_RATIOS:
        clip = torch.full((out, groups), ratio, device=w.device)
        dq = fake_int4(w, group_size, symmetric, clip).view(out, groups, group_size)
        err = torch.einsum("ogk,tgk->ogt", wg - dq, xg).pow(2).mean(dim=-1)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, clip, best)
    return best


@torch.no_grad()
def fold(scale: torch.Tensor, producer: torch.nn.Module, consumers: list[torch.nn.Module]):
    """Divide the producer's outputs by s (norm weight, or linear output rows) and multiply consumers' columns."""
    if producer.weight.dim() == 1:  # RMSNorm
        producer.weight.div_(scale.to(producer.weight.dtype))
    else:
        producer.weight.div_(scale.to(producer.weight.dtype)[:, None])
        if getattr(producer, "bias", None) is not None:
            producer.bias.div_(scale.to(producer.bias.dtype))
    for c in consumers:
        c.weight.mul_(scale.to(c.weight.dtype)[None, :])


def fold_groups(layer, cfg) -> list[tuple[torch.nn.Module, list[str]]]:
    """(producer, consumer projection names) for one Llama decoder layer. v_proj -> o_proj only without GQA,
    where o_proj's input channel j is exactly v_proj's output channel j."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])]
    if cfg.num_heads == cfg.num_kv_heads:
        groups.append((attn.v_proj, ["self_attn.o_proj"]))
    groups += [(layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"]), (mlp.up_proj, ["mlp.down_proj"])]
    return groups
