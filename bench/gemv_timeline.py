"""Where a decode GEMV's time goes: each program of the MMA GEMVs stamps the global ns clock at entry, after its PDL
wait, after its K loop and at its end (`quant_matmul.TRACE`), in a captured chain of launches over weight copies
that exceed L2 (as the tuner times them). Per launch, relative to the previous launch's last program end: when its
first program started, when the first wait returned, how long the programs streamed, and the split-K tail.

    PYTHONPATH=$PWD python bench/gemv_timeline.py --out bench/results/gemv_timeline_h200.jsonl
"""
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import graph_time_us, replay_time_us  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from quant_decode_sweep import BF16, SHAPES, quant_linears, random_weights, weight_copies  # noqa: E402  (this folder)
CALLS = 16


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2]


def timeline(traces: list[torch.Tensor]) -> dict:
    """Phase figures (us) over launches 2.. of one replay; traces[i]: int64 [programs, 4] ns stamps."""
    t = [tr.double().cpu() / 1e3 for tr in traces]
    rows = []
    for i in range(2, len(t)):
        prev_end = t[i - 1][:, 3].max().item()
        cur = t[i]
        rows.append(dict(period=cur[:, 3].max().item() - prev_end,
                         first_start=cur[:, 0].min().item() - prev_end,
                         started_before_prev_end=(cur[:, 0] < prev_end).double().mean().item(),
                         first_wait=cur[:, 1].min().item() - prev_end,
                         last_wait=cur[:, 1].max().item() - prev_end,
                         stream_median=(cur[:, 2] - cur[:, 1]).median().item(),
                         loops_done=cur[:, 2].max().item() - prev_end,
                         tail=cur[:, 3].max().item() - cur[:, 2].max().item()))
    return {key: round(_median([r[key] for r in rows]), 3) for key in rows[0]}


def _compiled() -> dict:
    """Every compiled MMA GEMV kernel so far, by id: (registers, spilled bytes) a thread."""
    found = {}
    for fn in (qm._w4a16_mma_gemv_kernel, qm._w8a16_mma_gemv_kernel):
        for caches in fn.device_caches.values():
            for k in caches[0].values():
                k._init_handles()
                found[id(k)] = (k.n_regs, k.n_spills)
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "lm_head"], choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    ap.add_argument("--kw-only", action="store_true", help="only the candidates whose warps split K (KW > 1)")
    ap.add_argument("--variants", nargs="*", type=json.loads, default=[],
                    help='JSON overrides timed beside each candidate, e.g. \'{"AHEAD": 2, "maxnreg": 72}\'')
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        for fmt in args.formats:
            mods, nbytes = quant_linears(fmt, random_weights(n, k, gen))
            configs = qm._mma_gemv_configs(1, 128) if fmt == "int4" else qm._mma_gemv8_configs(1, k)
            configs = [c for c in configs if c["KW"] > 1 or not args.kw_only]
            configs += [dict(c, **v) for c in configs for v in args.variants]
            for cfg in configs:
                def call(q, cfg=cfg):
                    if fmt == "int4":
                        return qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128, config=cfg)
                    return qm.w8a16_matmul_triton(x, q.qweight, q.scales, config=cfg)
                calls = [lambda q=mods[i % copies]: call(q) for i in range(CALLS)]
                before = _compiled()
                us = graph_time_us(calls)
                regs = [v for key, v in _compiled().items() if key not in before]
                split = qm._split_k(dict(cfg), 1, n, k // (128 if fmt == "int4" else 64), x.device)
                programs = math.ceil(n / cfg["BLOCK_N"]) * split
                traces = [torch.zeros(programs, 4, dtype=torch.int64, device="cuda") for _ in range(CALLS)]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for c, tr in zip(calls, traces):
                        qm.TRACE = tr
                        c()
                qm.TRACE = None
                traced_us = replay_time_us(graph, 20) / CALLS  # stamps cost a little: both times reported
                emit({"bench": "gemv_timeline", "machine": machine, "shape": name, "n": n, "k": k, "format": fmt,
                      "config": {a: b for a, b in cfg.items() if a not in ("MMA_GEMV", "BLOCK_M", "num_stages")},
                      "programs": programs, "split": split, "us": round(us, 2),
                      "registers_spills": regs[0] if regs else None,
                      "traced_us": round(traced_us, 2), "gbs": round(nbytes / us / 1e3, 1), **timeline(traces)},
                     args.out)
            del mods
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
