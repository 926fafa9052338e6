"""docs/performance.md's figure: end-to-end results on the H200 as fractions of their rooflines, and where a batch-1
decode step of the 8B shape spends its time against its roofline. Reads the committed results; runs on CPU.
    python bench/plot_performance.py --results bench/results --out bench/results/performance_h200.png
"""
import argparse
import json
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = Path(args.results)
    labels, fractions = [], []
    for r in records(res / "latency_h200.jsonl"):
        if r.get("runner") == "brrr":
            labels.append(f"8B decode, batch {r['batch']}")
            fractions.append(r["fraction_of_roofline"])
    for r in records(res / "throughput_h200.jsonl"):
        labels.append(f"{r['model']} offline, 256 req")
        fractions.append(r["fraction_of_roofline"])

    prof = records(res / "profile_h200" / "profile.jsonl")
    floor = next(r["roofline_ms"] for r in prof if r["section"] == "replay" and r["batch"] == 1)
    replay = next(r["gpu_ms_per_step"] for r in prof if r["section"] == "replay" and r["packed"] and r["batch"] == 1)
    gemm = {(r["shape"], r["m"]): r["us"] for r in records(res / "profile_h200" / "gemm_bandwidth.jsonl")}
    layers = 32  # llama-3.1-8b
    gemm_ms = (layers * sum(gemm[(s, 1)] for s in ("qkv packed", "q/o", "gate_up packed", "down"))
               + gemm[("lm_head", 1)]) / 1e3
    wall = 1e3 / next(r["decode_tok_s"] for r in records(res / "latency_h200.jsonl")
                      if r.get("runner") == "brrr" and r["batch"] == 1)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.8))
    a.barh(labels, fractions, color="#4c72b0")
    a.axvline(1.0, color="k", lw=1)
    a.axvline(0.88, color="r", ls="--", lw=1, label="issue 4: batch-1 target 88%")
    a.axvline(0.70, color="orange", ls="--", lw=1, label="issue 4: throughput target 70%")
    for y, f in enumerate(fractions):
        a.text(f + 0.01, y, f"{f:.1%}", va="center")
    a.set_xlim(0, 1.1)
    a.set_xlabel("fraction of the roofline (measured copy bandwidth / matmul rate)")
    a.legend(loc="upper center", bbox_to_anchor=(0.45, -0.18), ncol=2, fontsize=8)
    a.invert_yaxis()
    steps = [("roofline: 15.0 GB / 4.28 TB/s", floor), ("cuBLAS GEMMs alone", gemm_ms),
             ("captured step (all kernels)", replay), ("engine, pipelined", wall)]
    b.barh([s for s, _ in steps], [ms for _, ms in steps], color=["#55a868", "#c44e52", "#8172b2", "#4c72b0"])
    for y, (_, ms) in enumerate(steps):
        b.text(ms + 0.05, y, f"{ms:.2f} ms ({floor / ms:.0%})", va="center")
    b.set_xlim(0, wall * 1.35)
    b.set_xlabel("ms per batch-1 decode step, llama-3.1-8b shape, bf16")
    b.invert_yaxis()
    fig.suptitle("brrr on one H200 against the roofline (bench/results)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
