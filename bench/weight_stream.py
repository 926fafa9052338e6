"""How fast can a decode kernel stream a quantized weight from HBM, by access pattern? A read-only Triton kernel
(xor of every word, one int32 out per program) over the int4 8B gate_up weight (28672 x 2048 bytes, 58.7 MB), with
no dequantization and no math, so the figure is the memory system's for the pattern alone:
  strips   a program owns BLOCK_N rows and walks K: each step reads WIDTH bytes of each row (rows 2048 B apart); the
           current decode kernels' pattern (WIDTH = 64: one int4 g128 group a step)
  tiles    the same steps over a tile-major layout: each program's step is one contiguous BLOCK_N x WIDTH run
Both over a grid like the kernels' (row blocks x K splits, ~4 or ~8 programs per SM), with Triton software pipelining
of STAGES steps (cp.async into shared memory) or none. bf16 F.linear at M = 1 and a device-to-device copy on the
same GPU are the references. Timed as CUDA-graph replays over copies that exceed L2 (`graph_time_us`).

    PYTHONPATH=$PWD python bench/weight_stream.py --out bench/results/weight_stream_h200.jsonl
"""
import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels.dispatch import num_sms  # noqa: E402


@triton.jit
def _read_kernel(P, OUT, stride_row, stride_step, stride_tile, steps, per_split, BLOCK_N: tl.constexpr,
                 WORDS: tl.constexpr, STAGES: tl.constexpr, WORK: tl.constexpr):
    """Program (row block, K split) xors its steps: step s of row r at P + tile * stride_tile + r * stride_row + s *
    stride_step (words). WORK: that many dependent fp32 fmas per loaded word as well (a stand-in for dequantization
    and dot-product work: WORK / 8 instructions per int4 weight)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    ptrs = (P + pid_n.to(tl.int64) * stride_tile + tl.arange(0, BLOCK_N)[:, None] * stride_row
            + tl.arange(0, WORDS)[None, :])
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    work = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for s in tl.range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, steps), num_stages=STAGES):
        w = tl.load(ptrs + s * stride_step)
        acc ^= w
        f = ((w & 0x3FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)  # in [1, 2)
        for _ in tl.static_range(WORK):
            work = tl.fma(work, f, 0.5)
    # the work must reach the output to be kept; it never changes it (the sum is never exactly -1)
    tl.store(OUT + pid_n * tl.num_programs(1) + pid_k, tl.reduce(acc, None, _xor) ^ (tl.sum(work) == -1.0).to(tl.int32))


@triton.jit
def _xor(a, b):
    return a ^ b


def read(words: torch.Tensor, layout: str, n: int, row_words: int, block_n: int, width: int, per_sm: int,
         stages: int, warps: int, work: int = 0):
    """One launch over `words` ([n * row_words] int32) in `layout`; returns the per-program xors."""
    w = width // 4
    steps = row_words // w
    tiles = n // block_n
    split = max(1, min(steps, per_sm * num_sms(words.device.index or 0) // tiles))
    per_split = math.ceil(steps / split)
    out = torch.empty(tiles * split, dtype=torch.int32, device=words.device)
    if layout == "strips":  # row-major [n, row_words]
        strides = (row_words, w, block_n * row_words)
    else:  # tile-major [n / block_n, steps, block_n, w]
        strides = (w, block_n * w, block_n * row_words)
    _read_kernel[(tiles, split)](words, out, *strides, steps, per_split, BLOCK_N=block_n, WORDS=w, STAGES=stages,
                                 WORK=work, num_warps=warps, num_stages=max(stages, 1))
    return out


def xor_all(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().numpy()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--row-bytes", type=int, default=2048)
    ap.add_argument("--sections", nargs="+", default=["patterns", "work"])
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    n, row_words = args.n, args.row_bytes // 4
    nbytes = n * args.row_bytes
    copies = max(3, math.ceil(4 * 60e6 / nbytes))
    bufs = [torch.randint(-2**31, 2**31 - 1, (n * row_words,), dtype=torch.int32, device="cuda")
            for _ in range(copies)]

    def record(**kw):
        emit({"bench": "weight_stream", "machine": machine, "n": n, "row_bytes": args.row_bytes, **kw},
             args.out)

    want = xor_all(bufs[0])
    bf16 = [torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(max(3, copies // 4))]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    us = graph_time_us([lambda w=w: F.linear(x, w) for w in bf16])
    record(pattern="bf16 F.linear M=1 (28672x4096)", us=round(us, 2), gbs=round(n * 4096 * 2 / us / 1e3, 1))
    dst = torch.empty_like(bufs[0])
    us = graph_time_us([lambda b=b: dst.copy_(b) for b in bufs])
    record(pattern="copy (read + write)", us=round(us, 2), gbs=round(2 * nbytes / us / 1e3, 1))
    for layout, block_n, width, per_sm, stages, warps in itertools.product(
            ("strips", "tiles"), (32, 64, 128), (64, 128, 256), (4, 8), (1, 2, 3, 4), (4,)):
        if "patterns" not in args.sections:
            break
        if block_n * width // (32 * warps * 4) < 1:
            continue
        try:  # every word read exactly once: the programs' xors xor to the buffer's
            got = read(bufs[0], layout, n, row_words, block_n, width, per_sm, stages, warps)
            if xor_all(got) != want:
                raise AssertionError(f"{layout} {block_n}x{width}: the kernel missed or repeated words")
            us = graph_time_us([lambda b=b: read(b, layout, n, row_words, block_n, width, per_sm, stages, warps)
                                for b in bufs])
        except (RuntimeError, triton.runtime.errors.OutOfResources) as e:  # e.g. shared memory over the limit
            record(pattern=layout, block_n=block_n, width=width, per_sm=per_sm, stages=stages, warps=warps,
                   error=type(e).__name__)
            continue
        record(pattern=layout, block_n=block_n, width=width, per_sm=per_sm, stages=stages, warps=warps,
               us=round(us, 2), gbs=round(nbytes / us / 1e3, 1))
    # the same read with compute per word: where does the work start to cost bandwidth?
    for block_n, width, per_sm, warps, work in itertools.product((64, 128), (64, 128), (4, 8, 16), (4,),
                                                                  (4, 8, 16, 24, 32, 48)):
        if "work" not in args.sections:
            break
        us = graph_time_us([lambda b=b: read(b, "strips", n, row_words, block_n, width, per_sm, 1, warps, work)
                            for b in bufs])
        record(pattern="strips+work", block_n=block_n, width=width, per_sm=per_sm, stages=1, warps=warps, work=work,
               fma_per_int4_weight=work / 8, us=round(us, 2), gbs=round(nbytes / us / 1e3, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
