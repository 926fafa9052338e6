"""What a sum across a program's warps costs in Triton: a [W, D] fp32 tile (one row a warp, as the lean decode
kernel's weighted sums are) summed over W by `tl.sum`, against the same sum through a global scratch (each warp
stores its row, a barrier, each thread loads its columns' W partials and sums them itself), and a GEMV epilogue's
[8 x KW] row sums over KW warps. Each program stamps its SM clock before the load and after the store (a barrier
first); the records hold the median cycles over 32 programs, and us a launch over 64 launches in a CUDA graph.

    python bench/warp_reduce.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _reduce_kernel(X, Y, S, T, W: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: no sum (each warp stores its row); 1: tl.sum over the warps; 2: through the scratch S; 3: a GEMV
    epilogue, [8 W, 16] words as the MMA GEMV holds them summed over their 16 columns, then over the W warps."""
    pid = tl.program_id(0)
    c0 = _clock()
    w = tl.arange(0, W)[:, None]
    d = tl.arange(0, D)[None, :]
    if MODE == 3:
        t = tl.arange(0, 8 * W)[:, None]
        c = tl.arange(0, 16)[None, :]
        acc = tl.load(X.to(tl.pointer_type(tl.int32), bitcast=True) + pid * 128 * W + t * 16 + c).to(tl.float32)
        rows = tl.reshape(tl.sum(tl.reshape(tl.sum(acc, axis=1), (1, W, 8)), axis=1), (8,))
        tl.store(Y + pid * 8 + tl.arange(0, 8), rows)
    else:
        x = tl.load(X + pid * W * D + w * D + d).to(tl.float32) * 1.5 + 0.5
        if MODE == 0:
            tl.store(Y + pid * W * D + w * D + d, x)
        elif MODE == 1:
            tl.store(Y + pid * D + tl.arange(0, D), tl.sum(x, 0))
        else:
            base = S + pid * W * D
            tl.store(base + d * W + w, x)
            tl.debug_barrier()
            cols = tl.arange(0, D)[:, None]
            ws = tl.arange(0, W)[None, :]
            tl.store(Y + pid * D + tl.arange(0, D), tl.sum(tl.load(base + cols * W + ws), 1))
    tl.debug_barrier()
    c1 = _clock()
    tl.store(T + pid, c1 - c0)


def _launch_us(fn, n: int = 64, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n)
    return round(sorted(times)[reps // 2], 3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/warp_reduce.py needs a CUDA GPU", file=sys.stderr)
        return 2
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    modes = {0: "none", 1: "tl.sum across warps", 2: "global scratch", 3: "GEMV epilogue (8 rows x W warps)"}
    for w, d, cases in ((8, 128, (0, 1, 2)), (4, 128, (0, 1, 2)), (2, 128, (0, 1, 2)), (16, 16, (3,)), (8, 16, (3,))):
        x = torch.randn(32 * w * 256, device="cuda", dtype=torch.bfloat16)
        y, s = (torch.zeros(32 * w * 128, device="cuda") for _ in range(2))
        t = torch.zeros(32, dtype=torch.int64, device="cuda")
        for mode in cases:
            us = _launch_us(lambda: _reduce_kernel[(32,)](x, y, s, t, w, d, mode, num_warps=w))
            rec = {"bench": "warp_reduce", "machine": machine, "warps": w, "tile": [w, d], "sum": modes[mode],
                   "cycles_median": int(t.float().median()), "us_a_launch": us}
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
