"""Q8_0, Q4_K, Q5_K and Q6_K projections load as group-wise QuantLinear (brrr/gguf/repack.py into
brrr/kernels/quant/groupwise.py), against the same file loaded with every projection dequantized (repack=False).

The repack is exact, so dequantize() equals the fallback's weight bit for bit. On CPU both forms then run F.linear on
those fp32 weights in the same shapes, so the logits are bit-equal too (tolerance 0); the packed serving form
(q/k/v, gate/up joined) sums over the same K in larger GEMMs, within 1e-5 of them. The Triton kernel's sums against
the torch reference: tests/kernels/test_groupwise.py."""
import logging

import pytest
import torch

import brrr
from brrr.config import EngineConfig
from brrr.gguf.load import load_gguf_model
from brrr.gguf.names import hf_name
from brrr.gguf.reader import open_gguf
from brrr.gguf.repack import REPACKABLE
from brrr.kernels import AttnMeta
from brrr.kernels.quant.groupwise import groupwise_bytes
from brrr.models.llama import LlamaAttention
from brrr.quant.linear import QuantLinear, projections
from brrr.sampling_params import SamplingParams
from brrr.serving_form import PackedAttention, prepare_for_serving

CPU = torch.device("cpu")
IDS = list(range(3, 40))
# (family, spec): one block type per file (Qwen2: q/k/v biases), and Q4_K_M's Q4_K/Q6_K mix (Llama: q/k rows
# reordered on load)
CASES = [("qwen2", "q8_0"), ("qwen2", "q4_k"), ("qwen2", "q5_k"), ("qwen2", "q6_k"), ("llama", "q4_k_m")]


def _logits(model, ids):
    n = len(ids)
    with torch.no_grad():
        return model.logits(torch.tensor(ids), torch.arange(n), AttnMeta.causal([n], "cpu"))


def _greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_logits(model, ids)[-1].argmax()))
    return ids[-n:]


def _file_formats(path):
    """HF projection name -> the group-wise format of its tensor's block type in the file."""
    return {hf_name(name).removesuffix(".weight"): REPACKABLE[t.type]
            for name, t in open_gguf(path).tensors.items() if t.type in REPACKABLE}


@pytest.mark.parametrize("family, spec", CASES)
def test_repacked_projections_equal_the_dequantized_ones(wide_gguf, family, spec):
    path = wide_gguf(family, spec)
    packed = load_gguf_model(path, torch.float32, CPU)
    plain = load_gguf_model(path, torch.float32, CPU, repack=False)
    assert packed.gguf_fallback == () and len(plain.gguf_fallback) == 14
    formats = _file_formats(path)
    assert set(formats.values()) == ({"q4_k", "q6_k"} if spec == "q4_k_m" else {spec})
    for name, m in projections(packed):
        assert isinstance(m, QuantLinear) and m.fmt == formats[name], name
        assert m.stored_bits == 8 * groupwise_bytes(m.fmt, m.out_features, m.in_features)
        assert torch.equal(m.dequantize(), plain.get_submodule(name).weight), name
    assert torch.equal(_logits(packed, IDS), _logits(plain, IDS))
    assert _greedy(packed, IDS, 6) == _greedy(plain, IDS, 6)


def test_packed_serving_form_joins_only_layouts_that_match(wide_gguf):
    """Q4_K_M: layer 0's q/k/v are all Q4_K and join into one q4_k GEMM; layer 1's v is Q6_K, so its q/k/v stay
    three projections. gate/up are Q4_K in both layers and join."""
    path = wide_gguf("llama", "q4_k_m")
    plain = load_gguf_model(path, torch.float32, CPU, repack=False)
    model = load_gguf_model(path, torch.float32, CPU)
    layer0 = model.model.layers[0].self_attn
    qkv_parts = [layer0.q_proj, layer0.k_proj, layer0.v_proj]
    model = prepare_for_serving(model, EngineConfig(pack_projections=True))
    first, second = model.model.layers
    assert isinstance(first.self_attn, PackedAttention) and first.self_attn.qkv_proj.fmt == "q4_k"
    assert torch.equal(first.self_attn.qkv_proj.dequantize(), torch.cat([m.dequantize() for m in qkv_parts]))
    assert isinstance(second.self_attn, LlamaAttention) and second.self_attn.v_proj.fmt == "q6_k"
    assert all(layer.mlp.gate_up_proj.fmt == "q4_k" for layer in (first, second))
    assert torch.allclose(_logits(model, IDS), _logits(plain, IDS), rtol=0, atol=1e-5)


def test_greedy_tokens_through_load_and_the_paged_engine(wide_gguf):
    path = wide_gguf("qwen2", "q4_k")
    want = _greedy(load_gguf_model(path, torch.float32, CPU, repack=False), IDS, 8)
    mine = brrr.load(path, device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert list(mine.generate_ids(IDS, params)) == want
    llm = brrr.LLM(str(path), device="cpu", num_blocks=32, block_size=16)
    assert llm.generate([{"prompt_token_ids": IDS}], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_the_load_says_which_projections_were_dequantized(wide_gguf, caplog):
    """Q5_0 has no brrr layout: its projections are dequantized, named with their type."""
    with caplog.at_level(logging.INFO, logger="brrr.gguf"):
        model = load_gguf_model(wide_gguf("qwen2", "q5_0"), torch.float32, CPU)
    assert len(model.gguf_fallback) == 14 and not any(isinstance(m, QuantLinear) for m in model.modules())
    assert "14 quantized projections dequantized" in caplog.text and "blk.1.ffn_down.weight (Q5_0)" in caplog.text
