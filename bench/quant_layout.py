"""The int4 weight stored by rows ([N, K/2]) against chunk-major (`qm.chunk_major`: every row's first 64 bytes, then
the next 64) for the W4A16 g128 candidates at M = 1 and 16 on three 8B projections: the tensor-core decode configs,
the first two MMA decode ones, the first three GEMV ones and the first MMA GEMV one, each timed on both layouts of
the same weights. CUDA-graph replays over copies that exceed L2 (`graph_time_us`), so every call reads from HBM.
bench/results/quant_layout_h200.jsonl also has int8, from 9b153da, where the W8A16 kernels read chunk-major too:
their GEMV ran 1.2-1.5x faster yet still slower than their tensor-core kernels, which lost 3-8%; so int8 stays by rows.

    PYTHONPATH=$PWD python bench/quant_layout.py --out bench/results/quant_layout_h200.jsonl
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "q/o": (4096, 4096)}
SHOWN = ("BLOCK_N", "GROUPS_PER_ITER", "SPLIT_K", "num_warps", "num_stages", "MMA", "CHUNKS", "MMA_GEMV", "PREFETCH")


def picks(configs: list[dict]) -> list[int]:
    first = lambda key, count: [i for i, c in enumerate(configs) if key(c)][:count]  # noqa: E731
    return (list(range(len(qm.SMALL_CONFIGS))) + first(lambda c: c.get("MMA"), 2) + first(lambda c: "CHUNKS" in c, 3)
            + first(lambda c: c.get("MMA_GEMV"), 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    machine = torch.cuda.get_device_name()
    for name, (n, k) in SHAPES.items():
        copies = max(3, math.ceil(4 * 60e6 / (n * k / 2)))
        mods = [QuantLinear("int4", formats.quantize_int4(torch.randn(n, k, device="cuda", generator=gen,
                                                                      dtype=torch.bfloat16) * 0.02, 128),
                            k, n, None, dtype=torch.bfloat16) for _ in range(copies)]
        layouts = {"rows": [q.qweight.reshape(n, -1).contiguous() for q in mods], "chunks": [q.qweight for q in mods]}
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            configs = qm.w4_configs(m, 128)
            for i in picks(configs):
                cfg, rec = configs[i], {}
                for layout, weights in layouts.items():
                    rec[layout] = round(graph_time_us([
                        lambda w=w, q=q: qm.w4a16_matmul_triton(x, w, q.scales, q.zeros, 128, config=cfg)
                        for w, q in zip(weights, mods)]), 2)
                emit(dict(machine=machine, format="int4", shape=name, m=m, i=i,
                          cfg={a: b for a, b in cfg.items() if a in SHOWN}, **rec), args.out)
        del mods, layouts
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
