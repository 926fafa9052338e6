"""Markdown tables from `brrr bench kernels` JSON records: python bench/kernels_table.py FILE.jsonl"""
import json
import sys


def fmt_rate(op_bound, r):
    return f"{r['tflops']:.0f} TFLOP/s" if op_bound == "compute" else f"{r['gbps']:.0f} GB/s"


def main(path):
    records = [json.loads(line) for line in open(path) if line.strip()]
    main_rows = [r for r in records if "triton" in r]
    print("| op | Triton | % of roofline | peers (rate, Triton speedup) |")
    print("| --- | --- | --- | --- |")
    for r in main_rows:
        peers = []
        for name, p in r["peers"].items():
            peers.append(f"{name}: error" if "error" in p else
                         f"{name}: {fmt_rate(r['bound'], p)} ({p['triton_speedup']:.2f}x)")
        print(f"| {r['op']} | {fmt_rate(r['bound'], r['triton'])} | {r['roofline_fraction']:.0%} | "
              f"{'; '.join(peers)} |")
    sweep = [r for r in records if "sweep" in r and "gbps" in r]
    if sweep:
        print("\n| decode sweep: batch x context | splits | block_n, warps, stages | GB/s | % of copy bandwidth |")
        print("| --- | --- | --- | --- | --- |")
        for r in sorted(sweep, key=lambda r: (r["sweep"].get("batch", 64), -r["gbps"])):
            c = r["sweep"]
            print(f"| {c.get('batch', 64)} x {c.get('context', 4096)} | {c['splits']} | {c['block_n']}, "
                  f"{c['num_warps']}, {c['num_stages']} | {r['gbps']:.0f} | {r['roofline_fraction']:.0%} |")
    for r in records:
        if "error" in r and "sweep" not in r:
            print(f"\nERROR {r['op']}: {r['error'][:300]}")


if __name__ == "__main__":
    main(sys.argv[1])
