"""Plot p99 TTFT and p99 TPOT against request rate from `brrr bench serve --save-result` files.

    python bench/plot_serve.py bench/results/serve_h200/*-rate-*.json --out bench/results/serve_h200/latency_vs_rate.png
"""
import argparse
import json
import math
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = defaultdict(list)
    for path in args.results:
        r = json.load(open(path))
        rate = float(r["request_rate"])
        # "inf" sends everything at once: place it at the achieved request throughput, marked.
        runs[r["model"].rsplit("ckpt-", 1)[-1]].append(
            (rate if math.isfinite(rate) else r["request_throughput"], math.isinf(rate), r["p99_ttft_ms"],
             r["p99_tpot_ms"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for model, points in sorted(runs.items()):
        points.sort()
        for ax, i, slo in ((axes[0], 2, 500), (axes[1], 3, 50)):
            ax.plot([p[0] for p in points], [p[i] for p in points], marker="o", label=model)
            for p in points:
                if p[1]:
                    ax.annotate("all at once", (p[0], p[i]), fontsize=7)
            ax.axhline(slo, color="gray", linestyle="--", linewidth=0.8)
    axes[0].set(xlabel="request rate (req/s)", ylabel="p99 TTFT (ms)", title="time to first token (SLO 500 ms)")
    axes[1].set(xlabel="request rate (req/s)", ylabel="p99 TPOT (ms)", title="time per output token (SLO 50 ms)")
    for ax in axes:
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
