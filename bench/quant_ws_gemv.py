"""The warp-specialized int4 GEMV (brrr/kernels/quant_gemv_ws.py) against the tuned MMA GEMV at M = 1 on the 8B
projections: both chained over weight copies that exceed L2 in one CUDA graph (the tuner's timing), under PDL.

    PYTHONPATH=$PWD python bench/quant_ws_gemv.py --out bench/results/quant_ws_gemv_h200.jsonl
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quant_decode_sweep import BF16, SHAPES, quant_linears, random_weights  # noqa: E402  (this folder)
from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant_gemv_ws as ws  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--shapes", nargs="+", default=["qkv", "q/o", "gate_up", "down", "lm_head"], choices=list(SHAPES))
    ap.add_argument("--kw", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--maxnreg", nargs="+", type=int, default=[48, 64])
    ap.add_argument("--pdl", type=int, default=3)
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        n, k = SHAPES[name]
        gated = name == "gate_up"
        mods, nbytes = quant_linears("int4", random_weights(n, k, gen))
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        tuned = (lambda q: q.gated(x)) if gated else (lambda q: q(x))
        ref = tuned(mods[0]).float()
        exact = mods[0].dequantize().float() @ x.float().t() if not gated else None
        base = {"bench": "quant_ws_gemv", "machine": machine, "shape": name, "n": n, "k": k}
        tuned_us = graph_time_us([lambda q=q: tuned(q) for q in mods])
        emit(dict(base, kernel="mma-gemv (tuned)", us=round(tuned_us, 2), gbs=round(nbytes / tuned_us / 1e3, 1)),
             args.out)
        for kw in args.kw:
            if (k // 128) % kw:
                continue
            for stages in args.stages:
                for regs in args.maxnreg:
                    def call(q, kw=kw, stages=stages, regs=regs):
                        return ws.w4a16_ws_gemv(x, q.qweight, q.scales, q.zeros, n, k, kw=kw, stages=stages,
                                                gated=gated, pdl=args.pdl, maxnreg=regs or None)
                    rec = dict(base, kernel="ws-gemv", kw=kw, stages=stages, maxnreg=regs)
                    try:
                        y = call(mods[0]).float()
                        err = (y - ref).abs().max().item() / ref.abs().max().item()
                        us = graph_time_us([lambda q=q: call(q) for q in mods])
                    except Exception as e:  # noqa: BLE001
                        emit(dict(rec, error=f"{type(e).__name__}: {str(e)[:300]}"), args.out)
                        continue
                    if exact is not None:
                        rec["rel_err_vs_fp32"] = round((y.t() - exact).abs().max().item() / exact.abs().max().item(), 6)
                    emit(dict(rec, us=round(us, 2), gbs=round(nbytes / us / 1e3, 1), vs_tuned=round(tuned_us / us, 3),
                              rel_diff_vs_tuned=round(err, 6)), args.out)
        del mods
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
