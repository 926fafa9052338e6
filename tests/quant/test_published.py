"""GPTQ (AutoGPTQ/GPTQModel) and AWQ (GEMM) checkpoints, packed here from the published layout description (shifts
and ors over strided slices), load through brrr's loader and compute with exactly the weights they describe."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.quant.linear import QuantLinear, projections

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bits."""
    return torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32))


def _pack_rows(q):  # GPTQ qweight: [in, out] -> [in/8, out], row 8i+k in bits 4k..4k+3
    return _int32(sum(q[k::8].long() << (4 * k) for k in range(8)))


def _pack_cols(q, order=range(8)):  # [r, out] -> [r, out/8], bits 4k..4k+3 hold column 8j + order[k]
    return _int32(sum(q[:, order[k]::8].long() << (4 * k) for k in range(8)))


def _quantize(w, g_idx, groups, gen):
    """Integer codes [in, out], zeros [groups, out] and fp16 scales [groups, out] for weight w [out, in]."""
    out, n = w.shape
    zeros = torch.randint(1, 15, (groups, out), generator=gen)
    scales = (torch.rand(groups, out, generator=gen) * 0.02 + 0.01).half()
    q = torch.randint(0, 16, (n, out), generator=gen)
    dequant = ((q - zeros[g_idx]) * scales.float()[g_idx]).T
    return q, zeros, scales, dequant


def _write(tiny_dir, path, layout, act_order=False):
    """Rewrite the tiny model's projections in `layout`; returns the float weights they dequantize to."""
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    cfg = json.loads((tiny_dir / "config.json").read_text())
    expected = {}
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        name, w = key.removesuffix(".weight"), tensors.pop(key)
        out, n = w.shape
        groups = n // GROUP
        g_idx = torch.arange(n) // GROUP
        if act_order:  # desc_act: channel i belongs to the group of its position in a permutation
            g_idx = torch.argsort(torch.randperm(n, generator=gen)) // GROUP
        q, zeros, scales, expected[name] = _quantize(w, g_idx, groups, gen)
        if layout == "awq":
            tensors |= {f"{name}.qweight": _pack_cols(q, AWQ_ORDER), f"{name}.qzeros": _pack_cols(zeros, AWQ_ORDER),
                        f"{name}.scales": scales}
        else:
            stored_zeros = zeros - 1 if layout == "gptq" else zeros
            tensors |= {f"{name}.qweight": _pack_rows(q), f"{name}.qzeros": _pack_cols(stored_zeros),
                        f"{name}.scales": scales, f"{name}.g_idx": g_idx.to(torch.int32)}
    if layout == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                      "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
                                      "sym": False, "checkpoint_format": layout}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return expected


@pytest.mark.parametrize("layout,act_order", [("gptq", False), ("gptq", True), ("gptq_v2", True), ("awq", False)])
@torch.no_grad()
def test_published_checkpoints_load_and_match_their_dequantized_reference(tiny_dir, tmp_path, layout, act_order):
    expected = _write(tiny_dir, tmp_path / layout, layout, act_order)
    model = load_model(tmp_path / layout, dtype=torch.float32)
    reference = load_model(tiny_dir, dtype=torch.float32)
    for name, linear in projections(reference):
        linear.weight.copy_(expected[name])
    for name, m in projections(model):
        assert isinstance(m, QuantLinear)
        torch.testing.assert_close(m.dequantize(), expected[name])
    ids = torch.arange(1, 30)
    meta = AttnMeta.causal([len(ids)], "cpu")
    torch.testing.assert_close(model.compute_logits(model(ids, torch.arange(len(ids)), meta)),
                               reference.compute_logits(reference(ids, torch.arange(len(ids)), meta)))


def test_unsupported_published_configs_are_clear_errors(tiny_dir, tmp_path):
    _write(tiny_dir, tmp_path / "m", "awq")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for edit, message in (({"bits": 3}, "bits 3"), ({"version": "gemv"}, "GEMM packing with zero points only")):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
            **cfg["quantization_config"], **edit}}))
        with pytest.raises(BrrrError, match=message):
            load_model(tmp_path / "m")
