"""Adapters on disk in PEFT's format, so PEFT, transformers and vLLM read what brrr writes and brrr reads theirs:
`adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and `adapter_model.safetensors` with
tensors named `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. brrr's module names
are Hugging Face's (brrr/models/llama.py), so <module> is the same string in both."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from brrr.errors import BrrrError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features that change what the tensors mean; an adapter using one would load and compute something else.
_UNSUPPORTED = {"rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
                "bias": "none", "fan_in_fan_out": False}


@dataclass(frozen=True)
class LoraConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str  # PEFT's rule: names (suffix match) or one regex (full match)
    lora_dropout: float = 0.0
    use_rslora: bool = False
    use_dora: bool = False
    base_model_name_or_path: str | None = None

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise BrrrError(f"LoRA r must be a positive integer; got {self.r!r}")
        if not self.lora_alpha > 0:
            raise BrrrError(f"lora_alpha must be positive; got {self.lora_alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise BrrrError(f"lora_dropout must be in [0, 1); got {self.lora_dropout!r}")
        if not self.target_modules:
            raise BrrrError("target_modules is empty: name the projections the adapter trains (e.g. q_proj,v_proj)")

    @property
    def scaling(self) -> float:
        """The factor on B A x: alpha / r (rsLoRA: alpha / sqrt(r))."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft_json(self) -> dict:
        targets = self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.lora_alpha,
                "lora_dropout": self.lora_dropout, "target_modules": targets, "use_rslora": self.use_rslora,
                "use_dora": self.use_dora, "base_model_name_or_path": self.base_model_name_or_path,
                "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}

    @classmethod
    def from_peft_json(cls, data: dict, source: str = CONFIG_FILE) -> "LoraConfig":
        if data.get("peft_type") != "LORA":
            raise BrrrError(f"{source}: peft_type is {data.get('peft_type')!r}; brrr loads LORA adapters only")
        for key, plain in _UNSUPPORTED.items():
            if data.get(key, plain) not in (plain, None, {}, False, "none"):
                raise BrrrError(f"{source}: {key}={data[key]!r} is not supported (brrr loads plain LoRA/DoRA "
                                f"adapters: one r and alpha for every module, no extra trained modules)")
        targets = data.get("target_modules")
        if isinstance(targets, list):
            targets = tuple(targets)
        try:
            return cls(r=data["r"], lora_alpha=data["lora_alpha"], target_modules=targets,
                       lora_dropout=data.get("lora_dropout", 0.0), use_rslora=bool(data.get("use_rslora", False)),
                       use_dora=bool(data.get("use_dora", False)),
                       base_model_name_or_path=data.get("base_model_name_or_path"))
        except KeyError as e:
            raise BrrrError(f"{source}: missing field {e.args[0]!r}") from None


@dataclass
class LoraAdapter:
    """An adapter in memory: per target module, A [r, in] and B [out, r] (the update is scaling * B @ A), and for
    DoRA the magnitude vector [out] (the column norms of the adapted weight it rescales to)."""
    config: LoraConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None

    @property
    def rank(self) -> int:
        return self.config.r

    def delta(self, name: str) -> torch.Tensor:
        """scaling * B @ A, the dense update to module `name`'s weight [out, in] (merging; references)."""
        a, b = self.weights[name]
        return (b.float() @ a.float()) * self.config.scaling


def target_names(module_names, target_modules) -> list[str]:
    """The module names a LoRA config adapts, by PEFT's rule: a list matches a name equal to an entry or ending in
    '.' + entry; a string is a regular expression the whole name must match."""
    if isinstance(target_modules, str):
        return [n for n in module_names if re.fullmatch(target_modules, n)]
    return [n for n in module_names if any(n == t or n.endswith("." + t) for t in target_modules)]


def load_adapter(path, device="cpu", dtype: torch.dtype | None = None) -> LoraAdapter:
    """Read a PEFT LoRA directory. Errors name the file and the tensor."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        raise BrrrError(f"{path} is not a LoRA adapter: no {CONFIG_FILE}")
    try:
        config = LoraConfig.from_peft_json(json.loads(config_file.read_text()), str(config_file))
    except json.JSONDecodeError as e:
        raise BrrrError(f"{config_file} is not valid JSON: {e}") from None
    if weights_file.is_file():
        tensors = load_file(weights_file, device=str(device))
    elif (path / "adapter_model.bin").is_file():  # PEFT before safetensors
        tensors = torch.load(path / "adapter_model.bin", map_location=device, weights_only=True)
    else:
        raise BrrrError(f"{path}: no {WEIGHTS_FILE}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    magnitudes = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B|lora_magnitude_vector)(?:\.weight)?", key)
        if m is None:
            raise BrrrError(f"{weights_file}: unexpected tensor {key!r} (not a lora_A/lora_B weight)")
        name, kind = m.groups()
        t = t.to(dtype) if dtype is not None else t
        if kind == "lora_magnitude_vector":
            magnitudes[name] = t
        else:
            parts.setdefault(name, {})[kind] = t
    weights = {}
    for name, ab in parts.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise BrrrError(f"{weights_file}: {name} has {sorted(ab)} but needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise BrrrError(f"{weights_file}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have "
                            f"rank r={config.r} ([r, in] and [out, r])")
        weights[name] = (a, b)
    if not weights:
        raise BrrrError(f"{weights_file} holds no LoRA weights")
    return LoraAdapter(config, weights, magnitudes, path)


def save_adapter(path, adapter: LoraAdapter) -> Path:
    """Write the adapter as PEFT does (contiguous tensors, PEFT's names), creating the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in adapter.weights.items():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.detach().contiguous().cpu()
    for name, m in adapter.magnitudes.items():
        tensors[f"{_PREFIX}{name}.lora_magnitude_vector"] = m.detach().contiguous().cpu()
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(adapter.config.to_peft_json(), indent=2) + "\n")
    return path


def check_against(adapter: LoraAdapter, model: torch.nn.Module) -> None:
    """The adapter fits this model: every adapted module exists and is a linear layer of matching shape. Errors name
    the module and both shapes (an adapter trained for another base model fails here, before any request)."""
    modules = dict(model.named_modules())
    where = adapter.path or "the adapter"
    for name, (a, b) in adapter.weights.items():
        module = modules.get(name)
        if module is None:
            raise BrrrError(f"{where}: adapts {name!r}, which this model does not have (an adapter for another "
                            f"architecture?)")
        in_f, out_f = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if in_f is None or out_f is None:
            raise BrrrError(f"{where}: {name!r} is a {type(module).__name__}, not a linear layer LoRA can adapt")
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise BrrrError(f"{where}: {name} is {out_f}x{in_f} in this model but the adapter's update is "
                            f"{b.shape[0]}x{a.shape[1]} (an adapter for another base model?)")
