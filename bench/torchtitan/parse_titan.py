"""Reads one torchtitan run (its console log and each rank's TensorBoard scalars) and appends one JSON record.

  python3 parse_titan.py --log LOG --tb DUMP/tb --model llama-3.1-8b --nproc 4 --seq-len 4096 --local-batch 1 \
      --warmup 5 --out OUTFILE [--ac full] [--alloc-conf ...]

Steps 1..warmup (compilation, allocator growth) are dropped. Throughput is local tokens per step over the mean
step time of the rest (torchtitan's `time_metrics/end_to_end(s)`, the wall time between two log lines at
log_freq 1), averaged over ranks; "mfu" is torchtitan's own definition, "mfu_brrr_flops" the same tokens/s with
brrr's FLOP count and peak (`brrr bench train`'s definition). Memory: the largest per-step peak over ranks
and timed steps, both torchtitan's figures (max_active ~ brrr's max_memory_allocated, max_reserved what its
console line prints).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
                       r".*?tflops:\s*([\d,.]+).*?mfu:\s*([\d.]+)%")


def console_steps(log_text: str) -> dict[int, dict]:
    """Rank 0's step lines (torchrun --local-ranks-filter 0 keeps only its output)."""
    steps = {}
    for m in STEP_LINE.finditer(log_text):
        steps[int(m.group(1))] = {"loss": float(m.group(2)), "reserved_gib": float(m.group(3)),
                                  "tps": float(m.group(4).replace(",", "")),
                                  "tflops": float(m.group(5).replace(",", "")), "mfu_pct": float(m.group(6))}
    return steps


def tensorboard_ranks(tb_dir: str) -> dict[str, dict[str, dict[int, float]]]:
    """{rank dir: {tag: {step: value}}} from the event files torchtitan wrote with save_for_all_ranks."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for rank_dir in sorted(glob.glob(os.path.join(tb_dir, "*", "rank_*"))):
        acc = EventAccumulator(rank_dir, size_guidance={"scalars": 0})
        acc.Reload()
        out[os.path.basename(rank_dir)] = {tag: {e.step: e.value for e in acc.Scalars(tag)}
                                           for tag in acc.Tags()["scalars"]}
    return out


def brrr_flops(model: str, seq_len: int, gpu_name: str | None) -> tuple[float | None, float | None]:
    """brrr's training FLOPs per token (no recompute counted) and the datasheet bf16 peak of this GPU, as
    `brrr bench train` takes them (its peak is brrr.analysis.hardware's datasheet entry for the CUDA name)."""
    try:
        sys.path.insert(0, os.getcwd())
        from brrr.analysis.hardware import _known_spec
        from brrr.analysis.model import training_flops_per_token
        from brrr.presets import preset_config
    except Exception as e:  # the record still carries torchtitan's own numbers
        print(f"parse_titan: brrr not importable from {os.getcwd()} ({e})", file=sys.stderr)
        return None, None
    spec = _known_spec(gpu_name or "")
    return training_flops_per_token(preset_config(model), seq_len), spec.datasheet_peak("bf16") if spec else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True)
    p.add_argument("--tb", required=True, help="DUMP/tb: torchtitan's TensorBoard folder")
    p.add_argument("--model", required=True)
    p.add_argument("--flavor", required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--local-batch", type=int, required=True)
    p.add_argument("--ac", default="none")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--alloc-conf", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    log_text = open(args.log, errors="replace").read()
    shape = re.search(r"local batch size (\d+), global batch size (\d+).*?sequence length (\d+)", log_text)
    if shape:  # what torchtitan ran (a --training.* override on run_titan.sh's command line wins over its defaults)
        args.local_batch, args.seq_len = int(shape.group(1)), int(shape.group(3))
    console = console_steps(log_text)
    version = re.search(r"torchtitan version: (\S+)", log_text)
    peak_line = re.search(r"Peak FLOPS used for computing MFU: ([\d.e+]+)", log_text)
    gpu_line = re.search(r"[A-Z]+ capacity: (.+?) with [\d.]+GiB memory", log_text)
    record = {"peer": "torchtitan", "version": version.group(1) if version else None, "model": args.model,
              "titan_flavor": args.flavor, "nproc": args.nproc, "layout": f"FSDP2 x {args.nproc}" if args.nproc > 1
              else "one process (bf16 autocast)", "seq_len": args.seq_len, "local_batch": args.local_batch,
              "activation_checkpointing": args.ac, "compile": "per block + loss", "precision":
              "bf16 params/compute, fp32 reduce and master weights" if args.nproc > 1
              else "bf16 autocast, fp32 weights",
              "alloc_conf": args.alloc_conf or None, "exit_code": args.exit_code}
    try:
        ranks = tensorboard_ranks(args.tb)
    except Exception as e:
        print(f"parse_titan: TensorBoard scalars unreadable ({e}); using rank 0's console lines", file=sys.stderr)
        ranks = {}
    logged = sorted(console) or sorted({s for r in ranks.values() for s in r.get("throughput(tps)", {})})
    timed = [s for s in logged if s > args.warmup]
    record["steps"] = len(logged)
    record["timed_steps"] = len(timed)
    if not timed:
        record["error"] = f"no step after warmup {args.warmup} was logged (exit code {args.exit_code}); see the log"
    else:
        local_tokens = args.local_batch * args.seq_len
        step_s = [statistics.mean(r["time_metrics/end_to_end(s)"][s] for s in timed)
                  for r in ranks.values() if set(timed) <= set(r.get("time_metrics/end_to_end(s)", {}))]
        if step_s:
            record["step_s"] = statistics.mean(step_s)
            record["tokens_per_s_per_gpu"] = local_tokens / record["step_s"]
            mem_active = max((r["memory/max_active(GiB)"][s] for r in ranks.values() for s in timed
                              if s in r.get("memory/max_active(GiB)", {})), default=None)
            mem_reserved = max((r["memory/max_reserved(GiB)"][s] for r in ranks.values() for s in timed
                                if s in r.get("memory/max_reserved(GiB)", {})), default=None)
            record["ranks_read"] = len(step_s)
        else:  # console only: rank 0's tokens/s per step
            record["tokens_per_s_per_gpu"] = local_tokens / statistics.mean(local_tokens / console[s]["tps"]
                                                                           for s in timed)
            record["step_s"] = local_tokens / record["tokens_per_s_per_gpu"]
            mem_active, mem_reserved = None, max(console[s]["reserved_gib"] for s in timed)
            record["ranks_read"] = 1
        record["tokens_per_s"] = record["tokens_per_s_per_gpu"] * args.nproc
        peak = float(peak_line.group(1)) if peak_line else None
        tps_median = statistics.median(console[s]["tps"] for s in timed) if console else None
        titan_flops = None  # torchtitan's FLOPs per token, from its own tflops / tps of the last step
        for r in ranks.values():
            tps, tflops = r.get("throughput(tps)", {}), r.get("tflops", {})
            last = max(tps, default=None)
            if last is not None and tps[last] > 0 and last in tflops:
                titan_flops = tflops[last] * 1e12 / tps[last]
                break
        if titan_flops is None and console:
            titan_flops = console[timed[-1]]["tflops"] * 1e12 / console[timed[-1]]["tps"]
        record["titan_flops_per_token"] = titan_flops
        record["titan_peak_flops"] = peak
        record["mfu"] = record["tokens_per_s_per_gpu"] * titan_flops / peak if titan_flops and peak else None
        record["mfu_logged_median"] = statistics.median(console[s]["mfu_pct"] for s in timed) / 100 if console else None
        record["tps_logged_median"] = tps_median
        flops, brrr_peak = brrr_flops(args.model, args.seq_len, gpu_line.group(1) if gpu_line else None)
        record["brrr_flops_per_token"] = flops
        record["brrr_peak_flops"] = brrr_peak
        record["mfu_brrr_flops"] = (record["tokens_per_s_per_gpu"] * flops / brrr_peak
                                    if flops and brrr_peak else None)
        record["peak_memory_gib"] = mem_active if mem_active is not None else mem_reserved
        record["peak_memory_kind"] = "max_active (torchtitan)" if mem_active is not None else "max_reserved (console)"
        record["peak_reserved_gib"] = mem_reserved
        record["final_loss"] = console[logged[-1]]["loss"] if console else None
    record["gpu"] = gpu_line.group(1).strip() if gpu_line else None
    try:
        import torch
        record["torch"] = torch.__version__
    except Exception:
        pass
    line = json.dumps(record)
    print(line, flush=True)
    with open(args.out, "a") as f:
        f.write(line + "\n")
    return 0 if "error" not in record else 1


if __name__ == "__main__":
    sys.exit(main())
