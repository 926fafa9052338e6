"""Wall time of GPTQ (int4 g128, act-order) on the shipped default model, on the GPU and on the host, with the same
random calibration tokens: Hessians and the column sweep run where the model is.

  PYTHONPATH=$PWD python bench/gptq_time.py --out bench/results/gptq_time_h200.jsonl
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import brrr  # noqa: E402
from brrr.bench.latency import emit  # noqa: E402
from brrr.quant.methods import quantize_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    args = ap.parse_args(argv)
    calib = torch.randint(0, 8192, (args.samples, 256), generator=torch.Generator().manual_seed(0))
    for dev in args.devices:
        model = brrr.load(dtype="float32", device=dev).model
        params = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        quantize_model(model, "gptq", calib=calib)
        if dev == "cuda":
            torch.cuda.synchronize()
        emit({"bench": "gptq_time", "device": torch.cuda.get_device_name() if dev == "cuda" else f"host, "
              f"{torch.get_num_threads()} threads", "params": params, "calib_tokens": calib.numel(),
              "seconds": round(time.perf_counter() - t0, 2)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
