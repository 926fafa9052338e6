"""LoRA for training: `LoraLinear` wraps a frozen projection (an nn.Linear, or for QLoRA an NF4 `QuantLinear`) and
adds the trainable low-rank update, computed as PEFT computes it:

    y = base(x) + scaling * B(A(dropout(x)))          A [r, in] Kaiming-uniform, B [out, r] zeros at init

DoRA (Liu et al.) rescales each output row of the adapted weight to a trained magnitude m; like PEFT it treats the
row norm ||W + scaling B A|| as a constant in backward (the paper's section 4.3), which is also what makes
y = base(x) + (m / norm - 1) * (W x) + (m / norm) * scaling * B A x exact without forming W + B A.

`apply_lora` wraps a model's target modules and freezes everything else; `lora_state` reads the trained weights
out as a `LoraAdapter` (saved in PEFT's format by brrr.lora.save_adapter); `load_lora_state` puts an adapter's
weights back in (resuming, or starting from an adapter PEFT made). Adapter parameters stay fp32 (the master
weights); under bf16 autocast their matmuls run in bf16.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from brrr.errors import BrrrError
from brrr.lora.peft_format import LoraAdapter, LoraConfig, check_against, target_names
from brrr.quant.linear import QuantLinear


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, config: LoraConfig):
        super().__init__()
        self.base, self.config = base.requires_grad_(False), config
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling = config.scaling
        device = _device_of(base)
        self.lora_A = nn.Parameter(torch.empty(config.r, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, config.r, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's (and nn.Linear's) init of A
        self.dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        self.lora_magnitude = None
        self.disabled = False  # adapters_disabled(): the base alone (DPO/GRPO's reference)
        if config.use_dora:
            with torch.no_grad():
                self.lora_magnitude = nn.Parameter(self._row_norm(self.base_weight(torch.float32)))

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen weight [out, in] (dequantized for NF4), for DoRA's row norms."""
        if isinstance(self.base, QuantLinear):
            from brrr.lora.qlora import nf4_weight  # NF4 bases only: the QLoRA kernels load with the first one

            return nf4_weight(self.base, dtype)
        return self.base.weight.to(dtype)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.base, QuantLinear):
            from brrr.lora.qlora import nf4_linear  # NF4 bases only: the QLoRA kernels load with the first one

            return nf4_linear(x, self.base)
        return self.base(x)

    def delta(self) -> torch.Tensor:
        """scaling * B @ A in fp32 [out, in]."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def _row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.linalg.norm(weight + self.delta().detach().to(weight.dtype), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_forward(x)
        if self.disabled:
            return result
        dropped = self.dropout(x)
        a = self.lora_A if torch.is_autocast_enabled(x.device.type) else self.lora_A.to(x.dtype)
        b = self.lora_B if torch.is_autocast_enabled(x.device.type) else self.lora_B.to(x.dtype)
        lora = F.linear(F.linear(dropped, a), b)
        if self.lora_magnitude is None:
            return result + (lora * self.scaling).to(result.dtype)
        weight = self.base_weight(lora.dtype)
        scale = (self.lora_magnitude / self._row_norm(weight).detach()).to(lora.dtype)
        if dropped is x:
            base_result = result if getattr(self.base, "bias", None) is None else result - self.base.bias
        else:  # PEFT: with dropout the DoRA term sees the dropped-out input, base output included
            base_result = F.linear(dropped.to(weight.dtype), weight)
        return result + ((scale - 1) * base_result + scale * lora * self.scaling).to(result.dtype)

    def extra_repr(self) -> str:
        return f"r={self.config.r}, scaling={self.scaling:g}, dora={self.lora_magnitude is not None}"


def _device_of(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (isinstance(module, QuantLinear) and module.fmt == "nf4")


def apply_lora(model: nn.Module, config: LoraConfig, names: list[str] | None = None) -> dict[str, LoraLinear]:
    """Freeze the model and wrap its target modules (config.target_modules by PEFT's matching rule, or exactly
    `names`) in LoraLinear. Returns the wrappers by module name."""
    modules = dict(model.named_modules())
    if names is None:
        names = target_names(list(modules), config.target_modules)
        if not isinstance(config.target_modules, str):
            for entry in config.target_modules:
                if not target_names(list(modules), [entry]):
                    raise BrrrError(f"--target-modules: {entry!r} matches no module of this model (its projections "
                                    f"are {', '.join(_projection_kinds(modules))})")
        if not names:
            raise BrrrError(f"--target-modules {config.target_modules!r} matches no module of this model")
    model.requires_grad_(False)
    wrapped = {}
    for name in names:
        module = modules.get(name)
        if module is None:
            raise BrrrError(f"no module {name!r} in this model")
        if isinstance(module, LoraLinear):
            raise BrrrError(f"{name} already has a LoRA adapter")
        if not _adaptable(module):
            raise BrrrError(f"{name} is a {type(module).__name__}: LoRA adapts linear layers (nn.Linear, NF4)")
        parent, _, attr = name.rpartition(".")
        wrapped[name] = LoraLinear(module, config)
        setattr(model.get_submodule(parent), attr, wrapped[name])
    return wrapped


def _projection_kinds(modules: dict) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if _adaptable(m)})


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The model without its adapters inside the block (PEFT's disable_adapter): the frozen base, which is the
    reference of preference and RL training, with no second copy of the weights."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m in mods:
            m.disabled = False


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def lora_state(model: nn.Module, base_model_name_or_path: str | None = None) -> LoraAdapter:
    """The model's adapter weights (copies, on the CPU) as a LoraAdapter for save_adapter."""
    mods = lora_modules(model)
    if not mods:
        raise BrrrError("this model has no LoRA modules (apply_lora first)")
    config = next(iter(mods.values())).config
    targets = config.target_modules if isinstance(config.target_modules, str) else tuple(
        sorted({n.rsplit(".", 1)[-1] for n in mods}))
    config = LoraConfig(r=config.r, lora_alpha=config.lora_alpha, target_modules=targets,
                        lora_dropout=config.lora_dropout, use_rslora=config.use_rslora, use_dora=config.use_dora,
                        base_model_name_or_path=base_model_name_or_path or config.base_model_name_or_path)
    weights = {n: (m.lora_A.detach().float().cpu().clone(), m.lora_B.detach().float().cpu().clone())
               for n, m in mods.items()}
    magnitudes = {n: m.lora_magnitude.detach().float().cpu().clone() for n, m in mods.items()
                  if m.lora_magnitude is not None}
    return LoraAdapter(config, weights, magnitudes)


@torch.no_grad()
def load_lora_state(model: nn.Module, adapter: LoraAdapter) -> dict[str, LoraLinear]:
    """Copy the adapter's weights into the model's LoraLinear modules, wrapping the adapted modules first if the
    model has none. The adapter must fit: same modules, shapes (check_against) and rank."""
    mods = lora_modules(model)
    if not mods:
        check_against(adapter, model)
        mods = apply_lora(model, adapter.config, names=list(adapter.weights))
    for name, (a, b) in adapter.weights.items():
        module = mods.get(name)
        if module is None:
            raise BrrrError(f"{adapter.path or 'the adapter'}: adapts {name!r}, which has no LoRA module here")
        if module.lora_A.shape != a.shape or module.lora_B.shape != b.shape:
            raise BrrrError(f"{adapter.path or 'the adapter'}: {name}: lora_A {list(a.shape)} / lora_B "
                            f"{list(b.shape)} do not fit this model's {list(module.lora_A.shape)} / "
                            f"{list(module.lora_B.shape)} (another base model or rank?)")
        module.lora_A.copy_(a)
        module.lora_B.copy_(b)
        if module.lora_magnitude is not None:
            if name not in adapter.magnitudes:
                raise BrrrError(f"{adapter.path or 'the adapter'}: {name} has no DoRA magnitude vector")
            module.lora_magnitude.copy_(adapter.magnitudes[name])
    return mods


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
