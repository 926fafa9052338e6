"""Quantized checkpoints: model.safetensors holds the float tensors under their HF names and, for each quantized
projection, its format's tensors as `<projection>.<tensor>` (e.g. model.layers.0.self_attn.q_proj.qweight);
config.json carries `quantization_config` (quant_method "brrr", method, format, group size)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from brrr.errors import BrrrError
from brrr.state_dict import checkpoint_name, hf_state_dict
from brrr.quant.formats import DEQUANTIZE
from brrr.quant.linear import ACTIVATIONS, QuantLinear, projections
from brrr.quant.published import published_format

FORMAT_TENSORS = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros"),
                  "nf4": ("qweight", "absmax_q", "absmax_scales", "absmax_mean", "shape"), "fp8": ("qweight", "scales"),
                  "gptq": ("qweight", "qzeros", "scales", "g_idx"), "gptq_v2": ("qweight", "qzeros", "scales", "g_idx"),
                  "awq": ("qweight", "qzeros", "scales")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")  # transformers 5 saves the chat template in its own file


def save_quantized(model, config: dict, out_dir: str | Path, source_dir: str | Path | None = None,
                   dtype: torch.dtype | None = None):
    """Write the quantized model (float tensors in `dtype`, default their own) and copy the tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in hf_state_dict(model).items():
        is_float_param = v.is_floating_point() and not _is_quant_tensor(model, k)
        tensors[k] = (v.to(dtype) if dtype and is_float_param else v).detach().contiguous().cpu()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(dtype or model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    hf["quantization_config"] = config
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy(Path(source_dir) / name, out_dir / name)


def _is_quant_tensor(model, key: str) -> bool:
    parent, _, leaf = checkpoint_name(model.config, key).rpartition(".")
    try:
        return isinstance(model.get_submodule(parent), QuantLinear) and leaf != "bias"
    except AttributeError:
        return False


def quantization_config(path: Path) -> dict | None:
    if not Path(path).is_dir():  # a GGUF file: its block types are its quantization (brrr/gguf/)
        return None
    raw = json.loads((path / "config.json").read_text())
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if isinstance(qc, dict) and qc.get("quant_method") in ("gptq", "awq"):
        return {**qc, "format": published_format(qc, f"{path}/config.json")}
    if not isinstance(qc, dict) or qc.get("quant_method") != "brrr":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise BrrrError(f"{path}/config.json: quantization_config quant_method {method!r} is not supported "
                        "(brrr loads 'brrr' from `brrr quantize`, and 4-bit 'gptq' and 'awq')")
    if qc.get("format") not in FORMAT_TENSORS:
        raise BrrrError(f"{path}/config.json: quantization_config format must be one of "
                        f"{', '.join(FORMAT_TENSORS)}; got {qc.get('format')!r}")
    act = qc.get("activations")
    if act is not None and ACTIVATIONS.get(act) != qc["format"]:
        raise BrrrError(f"{path}/config.json: quantization_config activations {act!r} needs format "
                        f"{ACTIVATIONS.get(act, 'int8 or fp8')!r} (activations are one of {', '.join(ACTIVATIONS)}, "
                        f"each with weights of its own kind); got format {qc['format']!r}")
    return qc


def quantized_entries(files: list[Path], names, wanted):
    """(module name, tensor kind, the open file, key) of each tensor in the safetensors `files` whose kind (the key's
    last part) is in `names` and whose module wanted(module name) accepts; memory-mapped, read by the caller."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                parent, _, leaf = key.rpartition(".")
                if leaf in names and wanted(parent):
                    yield parent, leaf, f, key


def swap_quantized(model, qc: dict, files: list[Path], device) -> set[str]:
    """Replace each projection of `model` (on meta or empty) with a QuantLinear built from the checkpoint's tensors.
    Returns the checkpoint names consumed. Tensors that disagree with the config or the model: a clear error."""
    fmt, names = qc["format"], FORMAT_TENSORS[qc["format"]]
    lm_head = bool(qc.get("lm_head"))
    kinds = {n.rsplit(".", 1)[-1] for n, _ in projections(model, lm_head)}
    found: dict[str, dict] = {}
    consumed = set()
    for parent, leaf, f, key in quantized_entries(files, names, lambda module: module.rsplit(".", 1)[-1] in kinds):
        found.setdefault(checkpoint_name(model.config, parent), {})[leaf] = f.get_tensor(key)  # Mixtral's names
        consumed.add(key)
    for name, linear in projections(model, lm_head):
        tensors = found.get(name, {})
        missing = [t for t in names if t not in tensors]
        if missing:
            raise BrrrError(f"quantization_config says format {fmt!r}, but {name} lacks tensors {', '.join(missing)}")
        try:
            w = DEQUANTIZE[fmt](tensors)
        except Exception as e:
            raise BrrrError(f"{name}: {fmt} tensors do not fit together: {e}") from None
        if tuple(w.shape) != (linear.out_features, linear.in_features):
            raise BrrrError(f"{name}: {fmt} tensors dequantize to {tuple(w.shape)}, the config implies "
                            f"{(linear.out_features, linear.in_features)} (does quantization_config match?)")
        group_size = qc.get("group_size") or 0
        if fmt == "int4" and tensors["scales"].shape[1] * group_size != linear.in_features:
            raise BrrrError(f"{name}: {tensors['scales'].shape[1]} int4 groups, but quantization_config group_size "
                            f"{qc.get('group_size')} implies {linear.in_features // max(group_size, 1)}")
        bias = None
        if linear.bias is not None:
            bias = torch.empty(linear.out_features, dtype=linear.bias.dtype, device=device)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, QuantLinear(
            fmt, {k: tensors[k].to(device) for k in names}, linear.in_features, linear.out_features, bias,
            dtype=linear.weight.dtype, activations=qc.get("activations")))
    return consumed
