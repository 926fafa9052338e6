"""The roofline: attainable FLOP/s = min(peak, intensity x bandwidth), with named transformer ops placed on it.

An op's FLOPs and its minimum HBM traffic (each input read once, each output written once) give its arithmetic
intensity; below the ridge point (peak / bandwidth) it is memory-bound, above it compute-bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from brrr.analysis.hardware import GPU
from brrr.analysis.model import attention_flops_per_pair, is_mla, kv_bytes_per_token, qk_v_head_dims
from brrr.config import ModelConfig
from brrr.errors import BrrrError


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    dtype: str = "bf16"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul(m: int, n: int, k: int, dtype_bytes: int = 2, name: str | None = None, dtype: str = "bf16") -> Op:
    """(m x k) @ (k x n): 2mnk FLOPs; read both inputs, write the output."""
    return Op(name or f"matmul {m}x{n}x{k}", 2 * m * n * k, dtype_bytes * (m * k + k * n + m * n), dtype)


def place(op: Op, gpu: GPU) -> dict:
    """Where an op sits on this GPU's roofline: attainable FLOP/s, the bound, and the shortest time it can take."""
    peak = gpu.peak(op.dtype)
    attainable = min(peak, op.intensity * gpu.bandwidth)
    return {"name": op.name, "flops": op.flops, "bytes": op.bytes, "intensity": op.intensity,
            "bound": "compute" if op.intensity >= peak / gpu.bandwidth else "memory",
            "attainable_flops": attainable, "fraction_of_peak": attainable / peak,
            "min_time_s": max(op.flops / peak, op.bytes / gpu.bandwidth)}


def transformer_ops(cfg: ModelConfig, context: int = 4096, batch: int = 64, tokens: int = 4096) -> list[Op]:
    """Named ops at this model's shapes: square matmuls, decode GEMV/GEMM through the MLP's gate+up weights,
    one layer's causal attention prefill over `context` tokens and decode (one query per sequence, batch 1 and
    `batch`), RMSNorm over `tokens` rows, and a softmax over a tokens x tokens score matrix."""
    if context < 1 or batch < 1 or tokens < 1:
        raise BrrrError(f"context ({context}), batch ({batch}) and tokens ({tokens}) must be >= 1")
    h, nh, L = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    up = 2 * (cfg.moe_intermediate_size or cfg.intermediate_size)
    d_qk, d_v = qk_v_head_dims(cfg)
    ops = [matmul(n, n, n) for n in (256, 1024, 4096, 8192)]
    ops += [matmul(1, up, h, name=f"decode GEMV b=1 ({h}->{up})"),
            matmul(batch, up, h, name=f"decode GEMM b={batch} ({h}->{up})"),
            matmul(tokens, up, h, name=f"prefill GEMM {tokens} tokens ({h}->{up})")]
    # prefill: q and o per head; k and v per KV head (MLA prefill expands them per head)
    kv_heads = nh if is_mla(cfg) else cfg.num_kv_heads
    prefill_bytes = 2 * context * (nh * (d_qk + d_v) + kv_heads * (d_qk + d_v))
    pairs = context * (context + 1) // 2
    ops.append(Op(f"attention prefill {context} (causal, 1 layer)", attention_flops_per_pair(cfg) / L * pairs,
                  prefill_bytes))
    # decode: one query token per sequence reads its sequence's cached K/V (MLA: the latent)
    kv_layer = kv_bytes_per_token(cfg) / L
    for b in (1, batch):
        flops = attention_flops_per_pair(cfg, decode=True) / L * context * b
        ops.append(Op(f"attention decode b={b} x {context} (1 layer)", flops,
                      b * (context * kv_layer + 2 * 2 * nh * d_v)))
    ops.append(Op(f"RMSNorm {tokens}x{h}", 4 * tokens * h, 2 * (2 * tokens * h + h)))
    ops.append(Op(f"softmax {tokens}x{tokens}", 5 * tokens * tokens, 2 * 2 * tokens * tokens))
    return ops


def roofline(gpu: GPU, ops: list[Op], dtype: str = "bf16") -> dict:
    return {"gpu": gpu.name, "dtype": dtype, "peak_flops": gpu.peak(dtype), "bandwidth": gpu.bandwidth,
            "ridge": gpu.ridge(dtype), "ops": [place(op, gpu) for op in ops]}


def plot(gpu: GPU, ops: list[Op], path: str, dtype: str = "bf16", achieved: dict[str, float] | None = None) -> str:
    """Write the roofline with its ridge point and the ops to a PNG (needs matplotlib: pip install 'brrr[plot]').
    achieved: op name -> measured FLOP/s; those ops also get a hollow marker at the measured height, joined to
    their spot on the roof, and their label gives the fraction of the roof reached."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BrrrError("--plot needs matplotlib, which is not installed: pip install 'brrr[plot]'") from None
    import numpy as np

    placed = [place(op, gpu) for op in ops]
    achieved = achieved or {}
    lo = min([0.1] + [p["intensity"] / 2 for p in placed])
    hi = max([10 * gpu.ridge(dtype)] + [p["intensity"] * 2 for p in placed])
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    fig, ax = plt.subplots(figsize=(13, 6.5))
    ax.loglog(x, np.minimum(gpu.peak(dtype), x * gpu.bandwidth) / 1e12, color="black", lw=2,
              label=f"{dtype} roof: {gpu.peak(dtype) / 1e12:.0f} TFLOP/s, {gpu.bandwidth / 1e12:.2f} TB/s")
    if dtype != "fp8" and "fp8" in gpu.flops:
        ax.loglog(x, np.minimum(gpu.peak("fp8"), x * gpu.bandwidth) / 1e12, color="gray", ls="--", lw=1,
                  label=f"fp8 roof: {gpu.peak('fp8') / 1e12:.0f} TFLOP/s")
    ridge = gpu.ridge(dtype)
    ax.axvline(ridge, color="tab:red", ls=":", lw=1, label=f"ridge: {ridge:.0f} FLOP/byte")
    # number the points (ops at one intensity share a spot) and list the names beside the axes
    seen: dict[tuple, int] = {}
    for i, p in enumerate(placed, 1):
        color = "tab:blue" if p["bound"] == "memory" else "tab:green"
        ax.scatter(p["intensity"], p["attainable_flops"] / 1e12, color=color, zorder=3, s=25)
        spot = (round(np.log10(p["intensity"]), 1), round(np.log10(p["attainable_flops"]), 1))
        stack = seen[spot] = seen.get(spot, -1) + 1
        ax.annotate(str(i), (p["intensity"], p["attainable_flops"] / 1e12), textcoords="offset points",
                    xytext=(-10 + 9 * stack, 6), fontsize=8, color=color)
        if p["name"] in achieved:
            got = achieved[p["name"]] / 1e12
            ax.plot([p["intensity"]] * 2, [got, p["attainable_flops"] / 1e12], color=color, lw=0.8, alpha=0.6)
            ax.scatter(p["intensity"], got, facecolors="none", edgecolors=color, zorder=3, s=40)

    def label(p):
        got = achieved.get(p["name"])
        return f"{p['name']} ({p['bound']}" + (f", {got / p['attainable_flops']:.0%})" if got else ")")
    names = "\n".join(f"{i:>2}  {label(p)}" for i, p in enumerate(placed, 1))
    # the name list beside the axes gets the width its longest line needs (8 pt monospace: ~0.067 in a character)
    axes_in, text_in = 8.84, 0.3 + 0.067 * max(len(line) for line in names.splitlines())
    width = axes_in + max(text_in, 4.16)
    fig.set_size_inches(width, 6.5)
    fig.text(axes_in / width * 0.995, 0.5, names, fontsize=8, family="monospace", va="center")
    fig.subplots_adjust(left=0.91 / width, right=(axes_in - 0.26) / width, bottom=0.1, top=0.92)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of HBM traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Roofline: {gpu.name} ({gpu.source})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
