"""Does a decode GEMV lose bandwidth to uneven programs per SM? The MMA GEMVs at M = 1 over row counts whose
programs (row tiles x split K) fill the SMs evenly or not, as GB/s of stored bytes, beside a plain read of the same
bytes by a whole number of programs per SM (the ceiling). CUDA-graph chains over copies that exceed L2.

On the H200 (bench/results/gemv_balance_h200.jsonl) the answer was no: one config was faster at an even count, the
rest were not, and a stream-K kernel that gave every SM the same bytes ran slower still
(gemv_balance_stream_h200.jsonl).

    PYTHONPATH=$PWD python bench/gemv_balance.py --out bench/results/gemv_balance_h200.jsonl
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from brrr.kernels.dispatch import num_sms  # noqa: E402
from quant_decode_sweep import BF16, quant_linears, random_weights, weight_copies  # noqa: E402  (this folder)

CALLS = 16


@triton.jit
def _read_kernel(W, OUT, words, per_program, BLOCK: tl.constexpr):
    """Sum of this program's contiguous run of int32 words (a stand-in for streaming a weight once)."""
    begin = tl.program_id(0) * per_program
    end = tl.minimum(begin + per_program, words)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(begin, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < end, other=0)
    tl.store(OUT + tl.program_id(0), tl.sum(acc))


def read_us(bufs: list[torch.Tensor], programs: int) -> float:
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    words = bufs[0].numel()
    per = triton.cdiv(triton.cdiv(words, programs), 1024) * 1024
    calls = [lambda b=bufs[i % len(bufs)]: _read_kernel[(programs,)](b, out, words, per, BLOCK=1024, num_warps=4)
             for i in range(CALLS)]
    return graph_time_us(calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", nargs="+", type=int, default=[25344, 26400, 27456, 28512, 28672, 29568])
    ap.add_argument("--configs", nargs="+", default=["64,4,1", "64,4,2", "64,4,3", "128,8,2", "128,8,4", "256,8,4"],
                    help="BLOCK_N,warps,split")
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    ap.add_argument("--gated", action="store_true", help="gate/up with SiLU-and-mul in the epilogue (N = 2 x outputs)")
    ap.add_argument("--no-read", action="store_true", help="skip the plain-read ceiling")
    args = ap.parse_args(argv)
    machine, sms = torch.cuda.get_device_name(), num_sms(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = args.k
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    for n in args.rows:
        copies = weight_copies(n, k)
        for fmt in args.formats:
            mods, nbytes = quant_linears(fmt, random_weights(n, k, gen))
            bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
                    for _ in range(copies)]
            for programs in () if args.no_read else (4 * sms, 8 * sms):
                us = read_us(bufs, programs)
                emit({"bench": "gemv_balance", "machine": machine, "kernel": "read", "n": n, "k": k, "format": fmt,
                      "programs": programs, "per_sm": programs / sms, "us": round(us, 2),
                      "gbs": round(bufs[0].numel() * 4 / us / 1e3, 1)}, args.out)
            for spec in args.configs:
                bn, warps, split = (int(v) for v in spec.split(","))
                cfg = dict(MMA_GEMV=True, BLOCK_M=1, BLOCK_N=bn, AHEAD=False, SPLIT_K=split,
                           LAST_STEP_RELEASE=fmt == "int8", num_warps=warps, num_stages=1)

                def call(q, cfg=cfg):
                    if fmt == "int4":
                        return qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128, config=cfg,
                                                      gated=args.gated)
                    return qm.w8a16_matmul_triton(x, q.qweight, q.scales, config=cfg, gated=args.gated)
                us = graph_time_us([lambda q=mods[i % copies]: call(q) for i in range(CALLS)])
                programs = triton.cdiv(n, bn) * split
                emit({"bench": "gemv_balance", "machine": machine, "kernel": "mma-gemv", "n": n, "k": k,
                      "format": fmt, "block_n": bn, "warps": warps, "split": split, "gated": args.gated,
                      "programs": programs,
                      "per_sm": round(programs / sms, 2), "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1)},
                     args.out)
            del mods, bufs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
