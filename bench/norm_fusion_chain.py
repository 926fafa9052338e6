"""The RMSNorms inside the batch-1 MMA GEMVs, A/B on the GEMV chain alone (no attention): per layer, the packed q/k/v,
o, gate/up (gated) and down GEMVs of Llama-3.1-8B's shapes, int4 g128, over enough layers of distinct weights to
exceed L2, captured in one CUDA graph with PDL. Variants: the norms as kernels of their own (add_rms_norm, as the
engine ran before), both in the GEMVs (PendingNorm: the residual add in o/down, 1 / rms in q/k/v and gate/up), and
the residual add in o/down with the norms still kernels (rms_norm of the stream). o reads q/k/v's first 4096
outputs in place of attention's. Records: device us a layer.

    PYTHONPATH=$PWD python bench/norm_fusion_chain.py --out bench/results/norm_fusion_chain_h200.jsonl
"""
import argparse
import sys

import torch

from brrr.bench.latency import emit
from brrr.bench.timing import graph_time_us
from brrr.kernels.rms_norm import PendingNorm, add_rms_norm, rms_norm
from brrr.quant import formats
from brrr.quant.linear import QuantLinear

BF16, EPS = torch.bfloat16, 1e-5


def _layer(gen):
    def q(n, k):
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02
        return QuantLinear("int4", formats.quantize_int4(w, 128), k, n, None, dtype=BF16)
    mods = dict(qkv=q(6144, 4096), o=q(4096, 4096), gate_up=q(28672, 4096), down=q(4096, 14336))
    mods["qkv"].release_early = True
    norms = [(1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(BF16) for _ in range(2)]
    return mods, norms


def unfused(layers, h):
    y = torch.zeros_like(h)
    for m, (n1, n2) in layers:
        x, h = add_rms_norm(y, h, n1, EPS)
        a = m["qkv"](x)[:, :4096]
        x, h = add_rms_norm(m["o"](a), h, n2, EPS)
        y = m["down"](m["gate_up"].gated(x))
    return y


def fused(layers, h):
    x = rms_norm(h, layers[0][1][0], EPS)
    for i, (m, (_, n2)) in enumerate(layers):
        a = m["qkv"](x)[:, :4096]
        h, x = m["o"](a, residual=h, next_norm=(n2, EPS))
        nxt = layers[(i + 1) % len(layers)][1][0]
        h, x = m["down"](m["gate_up"].gated(x), residual=h, next_norm=(nxt, EPS))
    return h


def residual_only(layers, h):
    for m, (n1, n2) in layers:
        a = m["qkv"](rms_norm(h, n1, EPS))[:, :4096]
        h, _ = m["o"](a, residual=h, next_norm=(n2, EPS))
        h, _ = m["down"](m["gate_up"].gated(rms_norm(h, n2, EPS)), residual=h, next_norm=(n1, EPS))
    return h


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/norm_fusion_chain.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer(gen) for _ in range(args.layers)]
    h = torch.randn(1, 4096, device="cuda", generator=gen).to(BF16)
    variants = {"norm kernels (add_rms_norm)": unfused, "norms in the GEMVs": fused,
                "residual in o/down, norm kernels": residual_only}
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    for r in range(args.rounds):
        for name, fn in variants.items():
            us = graph_time_us([lambda fn=fn: fn(layers, h)], replays=20) / args.layers
            emit({"bench": "norm_fusion_chain", "machine": machine, "round": r, "variant": name,
                  "us_per_layer": round(us, 2)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
