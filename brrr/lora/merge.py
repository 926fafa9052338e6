"""`brrr merge`: fold a LoRA adapter into its base model's weights and write a plain Hugging Face directory.

Tensor by tensor through the base's safetensors files (so an 8B model never sits in memory whole): an adapted
projection's weight becomes W + scaling B A (DoRA: each row then rescaled to its magnitude m / ||W + scaling B A||),
computed in fp32 and stored back in the checkpoint's own dtype under the same name and shard; every other tensor is
copied as is. The other files of the base (config.json, tokenizer files, generation config, shard index) are copied,
so brrr and transformers load the result like the base.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from brrr.errors import BrrrError
from brrr.loader import weight_files
from brrr.lora.peft_format import LoraAdapter, load_adapter


def merged_tensor(weight: torch.Tensor, adapter: LoraAdapter, name: str) -> torch.Tensor:
    """The merged weight of module `name` in weight's dtype."""
    merged = weight.float() + adapter.delta(name)
    if name in adapter.magnitudes:
        merged = merged * (adapter.magnitudes[name].float() / torch.linalg.norm(merged, dim=1))[:, None]
    return merged.to(weight.dtype)


def merge_adapter(model_dir, adapter_dir, out_dir) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise BrrrError(f"--model {model_dir}: directory not found")
    if out_dir.resolve() == model_dir.resolve():
        raise BrrrError("--out must differ from --model (the base's files are read while the merged ones are written)")
    adapter = load_adapter(adapter_dir)
    if adapter.config.use_dora and set(adapter.magnitudes) != set(adapter.weights):
        raise BrrrError(f"{adapter_dir}: a DoRA adapter without a magnitude vector for every module")
    files = weight_files(model_dir)
    _check_shapes(files, adapter, adapter_dir, model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = {f"{name}.weight": name for name in adapter.weights}
    for file in files:
        tensors = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {"format": "pt"}
            for key in f.keys():
                t = f.get_tensor(key)
                name = pending.pop(key, None)
                if name is not None:
                    t = merged_tensor(t, adapter, name)
                tensors[key] = t.contiguous()
        save_file(tensors, str(out_dir / file.name), metadata=metadata)
    for extra in model_dir.iterdir():  # config, tokenizer, generation config, shard index; not unmerged weights
        if extra.is_file() and extra.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
            shutil.copyfile(extra, out_dir / extra.name)
    return out_dir


def _check_shapes(files, adapter: LoraAdapter, adapter_dir, model_dir):
    """Every adapted module is a 2-D weight of the adapter's shape in the base, checked before anything is written."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            shapes.update({key: f.get_slice(key).get_shape() for key in f.keys()})
    for name, (a, b) in adapter.weights.items():
        shape = shapes.get(f"{name}.weight")
        if shape is None:
            raise BrrrError(f"{adapter_dir} adapts {name!r}, which the base in {model_dir} does not have (an adapter "
                            f"for another architecture?)")
        if list(shape) != [b.shape[0], a.shape[1]]:
            raise BrrrError(f"{adapter_dir}: {name} is {list(shape)} in the base but the adapter's update is "
                            f"{[b.shape[0], a.shape[1]]} (an adapter for another base model?)")
