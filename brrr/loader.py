"""Load a Hugging Face model directory: safetensors (single file or sharded), memory-mapped, copied once
straight into parameters already allocated in the target dtype on the target device. A GGUF file goes to
brrr/gguf/load.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.gguf.load import load_gguf_model
from brrr.gguf.reader import is_gguf
from brrr.models import model_class
from brrr.quant.checkpoint import quantization_config, swap_quantized
from brrr.state_dict import checkpoint_name, hf_state_dict

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' (or None): the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return DTYPES.get(cfg.torch_dtype, torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise BrrrError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BrrrError(f"{index} is malformed (needs a 'weight_map' object): {e}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise BrrrError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (found pytorch_model.bin: brrr reads safetensors only)" if (path / "pytorch_model.bin").exists() else ""
        raise BrrrError(f"no *.safetensors weights in {path}{extra}")
    return files


def load_model(path: str | Path, dtype=None, device: str | torch.device = "cpu"):
    path = Path(path)
    if is_gguf(path):  # llama.cpp's single-file format (brrr/gguf/)
        cfg = ModelConfig.from_dir(path)
        return load_gguf_model(path, resolve_dtype(dtype, cfg, torch.device(device)), torch.device(device))
    if not path.is_dir():
        raise BrrrError(f"model directory not found: {path}")
    cfg = ModelConfig.from_dir(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, cfg, device)
    files = weight_files(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    filled: set[str] = set()
    qc = quantization_config(path)
    skip = swap_quantized(model, qc, files, device) if qc else set()  # projections -> QuantLinear, filled here
    for file in files:
        _load_file(model, file, filled, skip)
    missing = sorted(n for n, _ in model.checkpoint_tensors() if n not in filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise BrrrError(f"checkpoint in {path} is missing tensors: {shown}")
    model.requires_grad_(False).eval()
    return model


def checkpoint_entries(model, file: Path, skip=frozenset()):
    """(name, the parameter it fills, the open file) for each tensor of the safetensors `file` that goes into
    `model` (memory-mapped; derived and tied tensors skipped). Errors name the file and the tensor."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")  # memory-mapped
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt headers
        raise BrrrError(f"cannot read {file}: {e} (the file may be truncated or corrupt)") from None
    with handle as f:
        for name in f.keys():
            if name in skip:
                continue
            try:
                target = model.checkpoint_target(name)
            except AttributeError:
                raise BrrrError(f"{file}: tensor {name!r} does not belong to a {model.config.architecture}") from None
            if target is not None:
                yield name, target, f


def _load_file(model, file: Path, filled: set, skip: set = frozenset()):
    for name, target, f in checkpoint_entries(model, file, skip):
        try:
            tensor = f.get_tensor(name)
        except Exception as e:
            raise BrrrError(f"{file}: cannot read tensor {name!r}: {e}") from None
        if target.shape != tensor.shape:
            raise BrrrError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"the config implies {tuple(target.shape)}")
        target.data.copy_(tensor)
        filled.add(checkpoint_name(model.config, name))


def save_model(model, out_dir: str | Path, dtype: torch.dtype | None = None):
    """Write config.json + model.safetensors that both brrr and transformers load."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
