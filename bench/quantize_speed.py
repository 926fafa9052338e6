"""How long the calibrated methods take on a GPU. GPTQ's column sweep as one Triton launch per 128-column block
against the torch loop it replaced (~15 small ops a column), on single 8B projections (on the GPU, and the loop on
the host's CPU too); the kernel and the loop must give the same codes, and each record says whether they did. Then
`quantize_model` with each of `--methods` over a whole random-weight model on the GPU (calibration forwards,
Hessians and sweeps for GPTQ, scale and clip searches for AWQ).

    PYTHONPATH=$PWD python bench/quantize_speed.py --out bench/results/quantize_speed_h200.jsonl
"""
import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.models.random_weights import model_config, random_model  # noqa: E402
from brrr.kernels.dispatch import use_reference  # noqa: E402
from brrr.quant.gptq import Hessian, gptq_quantize  # noqa: E402
from brrr.quant.methods import quantize_model  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--cpu-loop", nargs="*", default=["q/o"], help="shapes whose torch loop is also timed on the CPU")
    ap.add_argument("--methods", nargs="*", default=["gptq", "awq"], help="timed over the whole model")
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    cfg = model_config(args.model)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in {"q/o": (h, h), "down": (h, inter)}.items():
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        x = torch.randn(4096, k, device="cuda", generator=gen)
        x = x * torch.rand(k, device="cuda", generator=gen).mul(3).exp()  # uneven channel scales, as real inputs
        hess = Hessian(k, "cuda")
        hess.add(x)
        for act_order in (True, False):
            kernel, kernel_s = timed(lambda: gptq_quantize(w, hess.H, 128, act_order=act_order))
            with use_reference():
                loop, loop_s = timed(lambda: gptq_quantize(w, hess.H, 128, act_order=act_order))
            rec = dict(bench="gptq_sweep", machine=machine, shape=name, n=n, k=k, act_order=act_order,
                       kernel_s=round(kernel_s, 3), torch_loop_gpu_s=round(loop_s, 3),
                       same_codes=all(torch.equal(kernel[t], loop[t]) for t in kernel))
            if name in args.cpu_loop:
                _, cpu_s = timed(lambda: gptq_quantize(w.cpu(), hess.H.cpu().double(), 128, act_order=act_order))
                rec["torch_loop_cpu_s"] = round(cpu_s, 3)
            emit(rec, args.out)
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    calib = torch.randint(0, cfg.vocab_size, (args.calib_samples, args.calib_seq_len),
                          generator=torch.Generator().manual_seed(0))
    for method in args.methods:
        model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
        _, total_s = timed(lambda m=model: quantize_model(m, method, 128, calib=calib))
        emit(dict(bench="quantize_model", machine=machine, model=args.model, method=method, layers=cfg.num_layers,
                  calib_tokens=calib.numel(), seconds=round(total_s, 1)), args.out)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
