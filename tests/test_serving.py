"""The serving form (`prepare_for_serving`: packed q/k/v and gate/up projections) computes what the reference
form computes; the reference keeps Hugging Face's modules and names."""
import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.kernels import AttnMeta
from brrr.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from brrr.loader import hf_state_dict
from brrr.models.llama import LlamaAttention, LlamaMLP
from brrr.serving_form import PackedAttention, PackedMLP, prepare_for_serving
from tests import hf_models

PACK = EngineConfig(pack_projections=True)


def _logits(model, n=11):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.logits(ids, torch.arange(n), AttnMeta.causal([n], "cpu"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("family", ["qwen2-bias", "qwen3-qknorm", "llama-attn-bias", "mqa", "tied"])
def test_serving_form_matches_the_reference(tmp_path, family, dtype, tol):
    path = hf_models.save(hf_models.build(family), tmp_path)
    ref, model = load_model(path, dtype=dtype), load_model(path, dtype=dtype)
    served = prepare_for_serving(model, PACK)
    assert served is model  # nn.Linear projections: swapped in place
    for layer in served.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert type(attn) is PackedAttention and type(mlp) is PackedMLP
        assert type(attn.qkv_proj) is torch.nn.Linear and not attn.decode_rope  # cuBLAS: the rotary kernel
        assert attn.qkv_proj.out_features == attn.n_heads * attn.head_dim + 2 * attn.n_kv * attn.head_dim
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")  # originals dropped, not kept beside
    names = set(dict(served.named_modules()))
    assert prepare_for_serving(served, PACK) is served and set(dict(served.named_modules())) == names  # idempotent
    for n in (11, 1):  # a prefill and a one-row step
        want, got = _logits(ref, n), _logits(served, n)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    split, hf_names = hf_state_dict(served), hf_state_dict(ref)
    assert split.keys() == hf_names.keys() and all(torch.equal(split[k], hf_names[k]) for k in hf_names)


def test_the_reference_form_stays_when_not_packing(tmp_path):
    """pack_projections False, or None where the Triton kernels do not run (this CPU): the reference, untouched."""
    path = hf_models.save(hf_models.build("llama-attn-bias"), tmp_path)
    model = load_model(path, dtype=torch.float32)
    for config in (EngineConfig(pack_projections=False), EngineConfig()):
        assert prepare_for_serving(model, config) is model
        assert all(type(layer.self_attn) is LlamaAttention and type(layer.mlp) is LlamaMLP
                   for layer in model.model.layers)


def test_the_engine_runs_the_serving_form(tmp_path):
    from brrr import SamplingParams
    from brrr.engine import LLMEngine

    path = hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    tokens = []
    for pack in (False, True):
        config = EngineConfig(num_blocks=32, pack_projections=pack)
        engine = LLMEngine(load_model(path, dtype=torch.float32), config=config)
        assert isinstance(engine.model.model.layers[0].self_attn, PackedAttention) == pack
        engine.add_request("r", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=8, temperature=0))
        while engine.has_unfinished_requests():
            out = [o for o in engine.step() if o.finished]
        tokens.append(out[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_silu_and_mul_reads_strided_halves():
    gate_up = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(1))
    gate_up = gate_up.cuda() if torch.cuda.is_available() else gate_up  # Triton runs on CUDA, or interpreted
    gate, up = gate_up.chunk(2, -1)  # row stride 600: the packed GEMM's output, read in place
    torch.testing.assert_close(silu_and_mul_triton(gate, up), silu_and_mul_ref(gate, up), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_heads_cut_from_the_packed_output():
    from brrr.kernels.rms_norm import rms_norm_ref, rms_norm_triton
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(2))
    qkv = qkv.cuda() if torch.cuda.is_available() else qkv
    q = qkv.split([64, 32, 32], -1)[0].view(7, 4, 16)  # row stride 128, heads 16 apart: not viewable as 2-D
    w = torch.rand(16, generator=torch.Generator().manual_seed(3)).to(qkv.device)
    torch.testing.assert_close(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), rtol=1e-6, atol=1e-6)
