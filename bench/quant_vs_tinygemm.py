"""brrr's tuned W4A16 g128 path beside torch's own int4 GEMM (`torch._weight_int4pack_mm`, tinygemm: what gpt-fast
runs) and bf16 F.linear, at the Llama-3.1-8B projection shapes and M = 1 ... 2048, on the same quantized weights:
device time (CUDA-graph replays over weight copies that exceed L2 for M <= 64) and each one's error against the
torch reference (bf16 weights dequantized exactly, then rounded once).

  PYTHONPATH=$PWD python bench/quant_vs_tinygemm.py --out bench/results/quant_vs_tinygemm_h200.jsonl
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BF16 = torch.bfloat16


def tinygemm_weights(ql: QuantLinear, inner_k_tiles: int = 8):
    """brrr's int4 tensors in tinygemm's layout. tinygemm computes (q - 8) * scale + zero, so the zero it gets is
    (8 - z) * s, rounded to bf16 (exact when z = 8, symmetric)."""
    codes = qm.unpack_int4_kernel(ql.qweight, ql.group_size)
    z = 8.0 if ql.zeros is None else ql.zeros.float()
    s = ql.scales.float()
    scale_zero = torch.stack([s, (8.0 - z) * s], -1).to(BF16).contiguous()
    return torch._convert_weight_to_int4pack((codes[:, ::2] << 4) | codes[:, 1::2], inner_k_tiles), scale_zero


def rel(got, want) -> float:
    return round(((got.float() - want.float()).norm() / want.float().norm()).item(), 7)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64, 256, 2048])
    args = ap.parse_args(argv)
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(3, math.ceil(4 * 60e6 / (n * k / 2)))  # the int4 copies span ~4x the 60 MB L2
        ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02 for _ in range(copies)]
        qls = [QuantLinear("int4", formats.quantize_int4(w, 128), k, n, None, dtype=BF16) for w in ws]
        tgs = [tinygemm_weights(q) for q in qls]
        x = torch.randn(16, k, device="cuda", generator=gen, dtype=BF16)
        ref = qm.w4a16_matmul_ref(x, qls[0].qweight, qls[0].scales, qls[0].zeros, 128)
        emit({"bench": "quant_vs_tinygemm_error", "machine": machine, "shape": name, "m": 16,
              "brrr_rel_err": rel(qls[0](x), ref),
              "tinygemm_rel_err": rel(torch._weight_int4pack_mm(x, tgs[0][0], 128, tgs[0][1]), ref)}, args.out)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=BF16)
            use = copies if m <= 64 else 1  # larger M is compute-bound: one copy, warm L2 or not
            with qm.quant_tuning():  # graph_time_us's warm-up calls tune brrr's kernels for this M
                brrr_us = graph_time_us([lambda q=q: q(x) for q in qls[:use]])
            us = {"bf16": graph_time_us([lambda w=w: F.linear(x, w) for w in ws[:use]]), "brrr": brrr_us,
                  "tinygemm": graph_time_us([lambda t=t: torch._weight_int4pack_mm(x, t[0], 128, t[1])
                                             for t in tgs[:use]])}
            emit({"bench": "quant_vs_tinygemm", "machine": machine, "shape": name, "n": n, "k": k, "m": m,
                  **{f"{v}_us": round(t, 2) for v, t in us.items()},
                  "brrr_vs_bf16": round(us["bf16"] / us["brrr"], 2),
                  "tinygemm_vs_bf16": round(us["bf16"] / us["tinygemm"], 2),
                  "brrr_vs_tinygemm": round(us["tinygemm"] / us["brrr"], 2)}, args.out)
        del ws, qls, tgs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
