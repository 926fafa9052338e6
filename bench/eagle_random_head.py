"""An EAGLE head of random weights for `brrr bench latency`'s random-weight target of a shape (same seed, dtype and
device as the bench builds it, so the head's target fingerprint matches). With it the bench times EAGLE drafting on
a real shape, the cost `brrr calc spec --draft eagle` predicts from the roofline; its drafts are random, so nearly
all are rejected: the run measures what drafting costs, not what it gains.

    python bench/eagle_random_head.py --model llama-3.1-8b --out /tmp/eagle-8b
    python -m brrr bench latency --model llama-3.1-8b --batch 1 --speculative-config \\
        '{"method": "eagle", "num_speculative_tokens": 4, "model": "/tmp/eagle-8b"}' --out spec_eagle_cost.jsonl
"""
from __future__ import annotations

import argparse

import torch

from brrr.bench.random_model import model_config, random_model
from brrr.loader import resolve_dtype
from brrr.models.eagle import new_head, save_head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset name or model directory (its shape)")
    p.add_argument("--out", required=True, help="the head's directory")
    p.add_argument("--dtype", default="bfloat16", help="as `brrr bench latency --dtype` (its default too)")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, cfg, device)
    target = random_model(cfg, dtype, device)
    head = new_head(target)
    save_head(head, args.out, dtype)
    print(f"wrote an EAGLE head for the random {args.model} ({dtype}, {device}) to {args.out}: "
          f"{sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
