"""Every W4A16 g128 / W8A16 decode candidate at M = 1 on the 8B projections, each timed alone (not just the tuner's
winner), plus software-pipelined variants (STAGES steps of weights in flight through shared memory): which kernel
family and pipeline depth streams the weight fastest, as GB/s of stored bytes and as a fraction of bf16 F.linear's.
CUDA-graph replays over copies that exceed L2 (`graph_time_us`), so every call reads its weight from HBM.

    PYTHONPATH=$PWD python bench/quant_decode_sweep.py --out bench/results/quant_decode_sweep_h200.jsonl
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "q/o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
BF16 = torch.bfloat16


def weight_copies(n: int, k: int) -> int:
    """Copies of an n x k weight whose int4 bytes exceed a 60 MB L2 four times over: every call reads HBM."""
    return max(3, math.ceil(4 * 60e6 / (n * k / 2)))


def random_weights(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """`weight_copies` random bf16 weights [n, k] (std 0.02) on the GPU."""
    return [torch.randn(n, k, device="cuda", generator=gen, dtype=BF16) * 0.02 for _ in range(weight_copies(n, k))]


def quant_linears(fmt: str, weights: list[torch.Tensor]) -> tuple[list[QuantLinear], int]:
    """RTN int4 g128 or int8 layers of `weights` [n, k] (bf16), and one layer's stored bytes."""
    n, k = weights[0].shape
    mods = [QuantLinear(fmt, formats.quantize_int4(w, 128) if fmt == "int4" else formats.quantize_int8(w), k, n, None,
                        dtype=BF16) for w in weights]
    return mods, sum(t.numel() * t.element_size() for t in mods[0].tensors().values() if t is not None)


def family(cfg: dict) -> str:
    return ("mma" if cfg.get("MMA") else "mma-gemv" if cfg.get("MMA_GEMV") else "gemv" if "CHUNKS" in cfg
            else "tensor-core")


def candidates(fmt: str, stages: list[int], splits: list[str]) -> list[dict]:
    """The tuner's candidates, then each MMA / GEMV one with `stages` steps pipelined and with each of `splits`, and
    each unpipelined MMA one loading the next group's x, zeros and scales a group ahead (AHEAD)."""
    base = qm.w4_configs(1, 128) if fmt == "int4" else qm.w8_configs(1)
    extra = []
    for cfg in base:
        if cfg.get("MMA") or "CHUNKS" in cfg:
            extra += [dict(cfg, num_stages=st, **({} if cfg.get("MMA") else {"STAGES": st})) for st in stages]
            extra += [dict(cfg, SPLIT_K=sk) for sk in splits if sk != cfg["SPLIT_K"]]
    extra += [dict(c, AHEAD=True) for c in base + extra if c.get("MMA") and c["num_stages"] == 1]
    return base + [c for i, c in enumerate(extra) if c not in extra[:i]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "lm_head"], choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["int4", "int8"])
    ap.add_argument("--stages", nargs="*", type=int, default=[2, 3])
    ap.add_argument("--splits", nargs="*", default=[], help="extra SPLIT_K values for the MMA / GEMV candidates")
    ap.add_argument("--families", nargs="+", default=["tensor-core", "mma", "gemv", "mma-gemv"])
    ap.add_argument("--int8-chunk-major", action="store_true",
                    help="also time the int8 MMA GEMV candidates on a chunk-major copy of the weights (layout chunks)")
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = random_weights(n, k, gen)
        copies = len(weights)
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        bf16_us = graph_time_us([lambda w=w: F.linear(x, w) for w in weights[:max(3, copies // 4)]])
        emit({"bench": "quant_decode_sweep", "machine": machine, "shape": name, "n": n, "k": k, "format": "bf16",
              "us": round(bf16_us, 2), "gbs": round(n * k * 2 / bf16_us / 1e3, 1)}, args.out)
        for fmt in args.formats:
            mods, nbytes = quant_linears(fmt, weights)
            ref = mods[0](x)
            runs = [(c, "rows") for c in candidates(fmt, args.stages, args.splits) if family(c) in args.families]
            if fmt == "int8" and args.int8_chunk_major:
                chunked = {id(q): qm.chunk_major(q.qweight) for q in mods}
                runs += [(c, "chunks") for c, _ in runs if c.get("MMA_GEMV")]
            for cfg, layout in runs:
                def call(q, cfg=cfg, layout=layout):
                    if fmt == "int4":
                        return qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128, config=cfg)
                    w = chunked[id(q)] if layout == "chunks" else q.qweight
                    return qm.w8a16_matmul_triton(x, w, q.scales, config=cfg)
                rec = {"bench": "quant_decode_sweep", "machine": machine, "shape": name, "n": n, "k": k,
                       "format": fmt, "family": family(cfg), "config": {a: b for a, b in cfg.items() if a != "MMA"}}
                if fmt == "int8":
                    rec["layout"] = layout
                try:
                    err = (call(mods[0]).float() - ref.float()).abs().max().item()
                    us = graph_time_us([lambda q=q: call(q) for q in mods])
                except Exception as e:  # noqa: BLE001  (e.g. shared memory over the limit: recorded, not fatal)
                    emit(dict(rec, error=f"{type(e).__name__}: {str(e)[:120]}"), args.out)
                    continue
                emit(dict(rec, us=round(us, 2), gbs=round(nbytes / us / 1e3, 1), vs_bf16=round(bf16_us / us, 3),
                          max_abs_diff_vs_tuned=round(err, 4)), args.out)
            del mods
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
