"""`brrr prune` (registered by brrr/cli.py): prune a model's projections and write an HF model directory that brrr
and transformers load (dense weights holding the zeros; config.json's `sparsity_config` says how)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

import brrr
from brrr.cli import HelpFormatter
from brrr.errors import BrrrError
from brrr.loader import DTYPES, save_model
from brrr.prune.layerwise import METHODS, NEEDS_CALIBRATION, prune_model
from brrr.prune.mask import parse_pattern
from brrr.quant.calib import calibration_tokens
from brrr.quant.checkpoint import TOKENIZER_FILES, quantization_config


def register(sub) -> None:
    p = sub.add_parser("prune", help="prune a model's linear layers (magnitude, Wanda, SparseGPT; N:M patterns such "
                       "as 2:4) and write an HF model directory", formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: brrr's shipped model)")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="magnitude (smallest |w| per row), wanda (|w| x input-feature norm per row), sparsegpt "
                        "(OBS pruning with weight updates, GPTQ's Hessian)")
    p.add_argument("--sparsity", type=float, default=None,
                   help="fraction of each row's weights to zero (e.g. 0.5); implied by --pattern")
    p.add_argument("--pattern", default=None,
                   help="N:M structured sparsity: N nonzeros in every M consecutive inputs (2:4 runs on sparse "
                        "tensor cores)")
    p.add_argument("--calib", default=None, help="calibration data (wanda, sparsegpt): brrr data dir or text file")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--device", default="cpu",
                   help="where the model is loaded and pruned (cuda: calibration passes, Hessians and sweeps there)")
    p.add_argument("--out", required=True, help="output HF model directory")
    p.set_defaults(func=cmd_prune)


def cmd_prune(args) -> int:
    pattern = parse_pattern(args.sparsity, args.pattern)
    if args.method in NEEDS_CALIBRATION and not args.calib:
        raise BrrrError(f"--method {args.method} needs calibration data: pass --calib DIR|FILE")
    pre = brrr.load(args.model, dtype="float32", device=args.device)
    if quantization_config(pre.path) is not None:
        raise BrrrError(f"{pre.path} is quantized: prune the unquantized model, then quantize the pruned one")
    calib = None
    if args.method in NEEDS_CALIBRATION:
        calib = calibration_tokens(args.calib, pre.tokenizer, args.calib_samples, args.calib_seq_len)
    t0 = time.perf_counter()
    config = prune_model(pre.model, args.method, pattern, calib, show_progress=True)
    save_pruned(pre.model, config, args.out, pre.path)
    print(json.dumps({"method": args.method, "out": args.out, "seconds": round(time.perf_counter() - t0, 2),
                      **config}))
    return 0


def save_pruned(model, config: dict, out: str | Path, source: Path) -> None:
    """The model in its checkpoint's dtype (zeros stay zeros in any), config.json with `sparsity_config`, and the
    source's tokenizer files."""
    out = Path(out)
    save_model(model, out, DTYPES.get(model.config.torch_dtype, torch.float32))
    hf = json.loads((out / "config.json").read_text())
    hf["sparsity_config"] = config
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
