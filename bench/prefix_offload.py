"""What a prefix hit from the prefix cache's host tier saves (--kv-offloading-size, brrr/engine/host_prefix.py).

Per shared-prefix length L: request A (the prefix + 32 tokens of its own) runs and leaves the prefix cached; then
request B (the same prefix + 32 other tokens) arrives, and its time to first token is measured in three modes:
  device     B comes right after A: the prefix's blocks are still in the GPU pool
  host       a filler request that needs the whole pool runs in between, so the prefix's blocks are evicted and,
             with the host tier on, copied to pinned host memory; B's prefix comes back over the host link
  recompute  the same, without the tier: B prefills its prefix again
The record holds each TTFT, the host hits (tokens) and the prompt tokens B computed, and the prefix's KV bytes.

  PYTHONPATH=$PWD python bench/prefix_offload.py --out bench/results/prefix_offload_h200.jsonl
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402

SUFFIX, BLOCK = 32, 16


def ttft(engine, rid: str, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token (the engine stepped to the end of it)."""
    from brrr import SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            sync()
            first = time.perf_counter() - t0
    return first


def main(argv=None):
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.engine.model_runner import kv_bytes_per_block
    from brrr.models.random_weights import model_config, random_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="preset name or model directory (random weights)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                    help="shared-prefix tokens (multiples of the block size)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if any(n % BLOCK for n in args.lengths):
        raise SystemExit(f"--lengths must be multiples of the block size {BLOCK}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(args.model)
    model = random_model(cfg, dtype, device)
    machine = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if device.type == "cuda"
               else f"cpu, torch {torch.__version__}")
    block_bytes = kv_bytes_per_block(cfg, BLOCK, dtype)
    for length in args.lengths:
        pool = (length + 2 * SUFFIX) // BLOCK + 1  # the filler's blocks: the spare goes to its last prompt token
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, cfg.vocab_size, (2 * length + 4 * SUFFIX + 1,), generator=g).tolist()
        prefix, filler = ids[:length], ids[length:2 * length + 2 * SUFFIX + 1]  # it takes every block of the pool
        a, b = prefix + ids[-2 * SUFFIX:-SUFFIX], prefix + ids[-SUFFIX:]
        rec = {"bench": "prefix_offload", "machine": machine, "model": f"{args.model} (random weights)",
               "prefix_len": length, "prefix_kv_bytes": length // BLOCK * block_bytes,
               "max_num_batched_tokens": args.max_num_batched_tokens}
        for mode in ("device", "host", "recompute"):
            tier_gib = 2 * pool * block_bytes / 2**30 if mode == "host" else 0.0
            engine = LLMEngine(model, None, EngineConfig(
                max_model_len=length + 3 * SUFFIX, max_num_seqs=1, num_blocks=pool,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=BLOCK,
                cuda_graphs=args.cuda_graphs == "on" and device.type == "cuda", kv_offloading_size=tier_gib))
            ttft(engine, "a", a)
            if mode != "device":
                ttft(engine, "filler", filler)  # needs every block: the prefix's go (to the host tier, if on)
            before = engine.stats()
            rec[f"ttft_{mode}_s"] = round(ttft(engine, "b", b), 5)
            after = engine.stats()
            rec[f"host_hits_{mode}"] = after["host_prefix_cache_hits"] - before["host_prefix_cache_hits"]
            rec[f"prompt_tokens_{mode}"] = after["prompt_tokens"] - before["prompt_tokens"]
            del engine
        if rec["ttft_host_s"] > rec["ttft_device_s"]:  # what the copies back cost, as a rate
            rec["host_copy_gbps"] = round(rec["prefix_kv_bytes"] / (rec["ttft_host_s"] - rec["ttft_device_s"]) / 1e9,
                                          1)
        emit(rec, args.out)


if __name__ == "__main__":
    main()
