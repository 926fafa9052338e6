"""W4A16 g128 at M = 16-256 on the 8B projections: the tuner's best swapped tile (y^T = W x^T, the dequantized
weight as the wgmma's register operand) against its best other candidate and bf16 F.linear, from the tuner's own
timings (`quant_matmul.TIMINGS`: chained over weight copies up to M = 16, alone with L2 flushed above).

    PYTHONPATH=$PWD python bench/quant_swap_tiles.py --out bench/results/quant_swap_tiles_h200.jsonl
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from quant_decode_sweep import BF16, SHAPES, quant_linears  # noqa: E402  (this folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--m", nargs="+", type=int, default=[16, 64, 128, 256], help="rows of x, each above 4")
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in ((s, SHAPES[s]) for s in SHAPES if s != "lm_head"):
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02
        (q,), _ = quant_linears("int4", [w])
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            bf16_us = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50) * 1e3
            qm.TIMINGS.clear()
            qm._TUNED.clear()
            err = ((q(x).float() - F.linear(x, q.dequantize().to(x.dtype)).float()).norm()
                   / F.linear(x, w).float().norm()).item()
            (timed,) = qm.TIMINGS.values()
            swap = min(((t, c) for c, t in timed if c.get("SWAP")), key=lambda tc: tc[0])
            other = min(((t, c) for c, t in timed if not c.get("SWAP")), key=lambda tc: tc[0])
            swap_us, other_us = swap[0] * 1e3, other[0] * 1e3
            emit({"bench": "quant_swap_tiles", "machine": machine, "shape": name, "n": n, "k": k, "m": m,
                  "bf16_us": round(bf16_us, 2), "swap_us": round(swap_us, 2), "other_us": round(other_us, 2),
                  "swap_vs_bf16": round(bf16_us / swap_us, 3), "other_vs_bf16": round(bf16_us / other_us, 3),
                  "swap_config": swap[1], "other_config": other[1], "rel_err_vs_dequantized": round(err, 5)},
                 args.out)
        del w, q
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
