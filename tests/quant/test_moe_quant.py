"""Quantized experts through `brrr quantize` and serving, on tiny Mixtral and Qwen2-MoE models written by
transformers: RTN int8 (per channel) and int4 g128 quantize the routed and shared experts and leave the routers in
floating point; the checkpoint reloads to the same tensors; the serving form stacks the experts into `QuantExperts`
and runs the fused quantized path (its torch reference on the CPU), whose logits are the dequantized-weights model's;
GPTQ rounds an expert that saw no calibration token to nearest instead of zeroing it; AWQ and SmoothQuant refuse."""
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from brrr.cli import main
from brrr.config import EngineConfig
from brrr.errors import BrrrError
from brrr.generate import forward_logits, generate_tokens
from brrr.kernels.moe_routing import route
from brrr.loader import load_model
from brrr.models.moe import QuantStackedMoeBlock, Router, SparseMoeBlock
from brrr.quant import formats
from brrr.quant.checkpoint import save_quantized
from brrr.quant.linear import QuantLinear, projections
from brrr.quant.methods import quantize_model
from brrr.sampling_params import SamplingParams
from brrr.serving_form import prepare_for_serving
from tests import hf_models

PACK = EngineConfig(pack_projections=True)
FORMAT = {"rtn-int8": "int8", "rtn-int4": "int4"}


def _save(family, path, **overrides):
    hf_models.save(hf_models.build(family, vocab_size=320, **overrides), path)
    hf_models.save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """Hidden and expert width 128: every projection holds whole int4 groups of 128."""
    return _save("mixtral", tmp_path_factory.mktemp("tiny-mixtral"), hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def qwen_moe_dir(tmp_path_factory):
    """Qwen2-MoE: a shared expert behind a sigmoid gate, a dense first layer, experts 32 wide."""
    return _save("qwen2-moe-shared-expert", tmp_path_factory.mktemp("tiny-qwen2-moe"))


def _expert_projections(model):
    return [(n, m) for n, m in projections(model) if ".experts." in n]


def _dequantized(model):
    """The reference: every QuantLinear of `model` replaced by an nn.Linear holding its dequantized weight."""
    for name, m in projections(model):
        if isinstance(m, QuantLinear):
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            linear.weight.data = m.dequantize()
            if m.bias is not None:
                linear.bias.data = m.bias.data.clone()
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, linear.requires_grad_(False))
    return model


def _quantized(path, method, **kw):
    model = load_model(path, dtype=torch.float32)
    return model, quantize_model(model, method, **kw)


@pytest.mark.parametrize("family,method", [("mixtral", "rtn-int8"), ("mixtral", "rtn-int4"),
                                           ("qwen2-moe", "rtn-int8")])
@torch.no_grad()
def test_rtn_experts_serve_stacked_with_the_dequantized_models_logits(mixtral_dir, qwen_moe_dir, family, method):
    path = mixtral_dir if family == "mixtral" else qwen_moe_dir
    model, config = _quantized(path, method)
    fmt = FORMAT[method]
    experts = _expert_projections(model)
    assert len(experts) == 3 * model.config.num_experts * sum(isinstance(layer.mlp, SparseMoeBlock)
                                                              for layer in model.model.layers)
    assert all(isinstance(m, QuantLinear) and m.fmt == fmt for _, m in projections(model))  # shared experts too
    assert all(type(m.weight) is nn.Parameter for m in model.modules() if isinstance(m, Router))  # routers: float
    for layer in model.model.layers:  # Qwen2-MoE's shared-expert gate is a router too
        gate = getattr(layer.mlp, "shared_expert_gate", None)
        assert gate is None or type(gate) is nn.Linear
    reference = _dequantized(load_model(path, dtype=torch.float32))
    quantize_model(reference, method)
    reference = _dequantized(reference)
    served = prepare_for_serving(model, PACK)
    sparse = [layer.mlp for layer in served.model.layers if not hasattr(layer.mlp, "down_proj")]
    assert sparse and all(type(b) is QuantStackedMoeBlock for b in sparse)
    assert all(s.fmt == fmt and s.qweight.shape[0] == model.config.num_experts for b in sparse for s in b.stacks())
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # fp32: the same weights, only the order of the sums differs (int8 scales after the sum on the dense GEMMs)
    torch.testing.assert_close(forward_logits(served, ids), forward_logits(reference, ids), atol=1e-4, rtol=1e-4)
    if fmt == "int8":
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert list(generate_tokens(served, ids[:8], params)) == list(generate_tokens(reference, ids[:8], params))


@torch.no_grad()
def test_a_quantized_moe_checkpoint_reloads_to_the_same_tensors(mixtral_dir, tmp_path):
    model, config = _quantized(mixtral_dir, "rtn-int4")
    save_quantized(model, config, tmp_path / "q", source_dir=mixtral_dir)
    with safe_open(str(tmp_path / "q" / "model.safetensors"), framework="pt") as f:  # Mixtral's names on disk
        assert f.get_tensor("model.layers.0.block_sparse_moe.experts.3.w2.scales").dtype == torch.float32
    loaded = load_model(tmp_path / "q", dtype=torch.float32)
    assert all(isinstance(m, QuantLinear) and m.fmt == "int4" and m.group_size == 128
               for _, m in _expert_projections(loaded))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = list(range(1, 30))
    torch.testing.assert_close(forward_logits(prepare_for_serving(loaded, PACK), ids), forward_logits(model, ids),
                               atol=1e-5, rtol=1e-5)


def test_brrr_quantize_writes_quantized_experts(mixtral_dir, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["quantize", "--model", str(mixtral_dir), "--method", "rtn-int8", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "int8"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["method"] == "rtn-int8"
    loaded = load_model(out, dtype=torch.float32)
    float_model = load_model(mixtral_dir, dtype=torch.float32)
    for name, m in _expert_projections(loaded):  # RTN of the float checkpoint's weights, as stored
        want = formats.quantize_int8(float_model.get_submodule(name).weight)
        assert isinstance(m, QuantLinear) and torch.equal(m.checkpoint_tensors()["qweight"], want["qweight"])
    assert isinstance(prepare_for_serving(loaded, PACK).model.layers[0].mlp, QuantStackedMoeBlock)


@torch.no_grad()
def test_gptq_rounds_experts_without_calibration_tokens_to_nearest(mixtral_dir):
    model = load_model(mixtral_dir, dtype=torch.float32)
    float_model = load_model(mixtral_dir, dtype=torch.float32)
    cfg = model.config
    chosen = {}  # MoE layer -> the experts its router picked during calibration (recorded here, independently)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda mod, args, out, i=i: chosen.setdefault(i, set()).update(
            route(out, cfg.num_experts_per_tok)[1].flatten().tolist()))
    calib = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(0))  # 6 choices for 8 experts
    quantize_model(model, "gptq", group_size=32, calib=calib)
    unseen = [(i, e) for i in chosen for e in range(cfg.num_experts) if e not in chosen[i]]
    assert unseen and len(chosen) == cfg.num_layers
    for i, layer in enumerate(model.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            for proj, name in zip(expert.projections(), expert.names):
                w = float_model.model.layers[i].mlp.experts[e].get_submodule(name).weight
                rtn = formats.quantize_int4(w, 32)
                got = proj.checkpoint_tensors()
                is_rtn = all(torch.equal(got[k], rtn[k]) for k in rtn)
                assert is_rtn == ((i, e) in unseen), (i, e, name)
                assert (proj.dequantize().abs().sum(dim=1) > 0).all()  # no row zeroed by an empty Hessian


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_scale_folding_methods_refuse_moe_models(mixtral_dir, method):
    model = load_model(mixtral_dir, dtype=torch.float32)
    with pytest.raises(BrrrError, match=f"--method {method} folds.*MoE model: use rtn-int8, rtn-int4 or gptq"):
        quantize_model(model, method, calib=torch.randint(0, 256, (2, 16)))
