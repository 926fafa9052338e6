"""GGUF files on CUDA: Q4_0 projections repacked into int4 group-32 QuantLinear run through the W4A16 Triton
kernels, Q8_0 / Q4_K / Q6_K ones into the group-wise QuantLinear formats through brrr/kernels/quant/groupwise.py;
both agree with the float32 dequantized reference, and the paged engine (CUDA graphs on, projections packed where
their layouts match) decodes the same greedy tokens as reference generation."""
import pytest
import torch

import brrr
from brrr.engine import LLM
from brrr.gguf.export import export_gguf
from brrr.gguf.load import load_gguf_model
from brrr.kernels import AttnMeta
from brrr.quant.linear import QuantLinear
from brrr.sampling_params import SamplingParams
from tests import hf_models

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-cuda")
    model = hf_models.build("llama-attn-bias", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=320)
    hf_models.save(model, d)
    hf_models.save_tokenizer(d)
    out = {}
    for t in ("q4_0", "q8_0", "q4_k_m", "q6_k", "f16"):
        out[t] = d / f"m-{t}.gguf"
        export_gguf(d, out[t], t)
    return out


def _logits(model, ids, device):
    n = len(ids)
    with torch.no_grad():
        return model.logits(torch.tensor(ids, device=device), torch.arange(n, device=device),
                            AttnMeta.causal([n], device)).float().cpu()


@pytest.mark.parametrize("file_type", ["q4_0", "q8_0", "q4_k_m", "q6_k", "f16"])
def test_cuda_logits_match_the_cpu_dequantized_reference(files, file_type):
    ids = list(range(3, 120))
    want = _logits(load_gguf_model(files[file_type], torch.float32, torch.device("cpu"), repack=False), ids, "cpu")
    model = load_gguf_model(files[file_type], torch.bfloat16, torch.device("cuda"))
    assert model.gguf_fallback == ()
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == (file_type != "f16")
    got = _logits(model, ids, "cuda")
    assert ((got - want).norm() / want.norm()).item() < 5e-2  # bf16 activations: 2.5% on the CPU


@pytest.mark.parametrize("file_type", ["q4_0", "q4_k_m"])
def test_paged_engine_greedy_tokens_equal_reference_generation(files, file_type):
    # float32: a tiny random model's logits are nearly flat, and in bf16 the packed GEMMs' other summation order
    # flips near-ties (Q4_K_M on the H200: token 8 of 16 differed)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = brrr.load(files[file_type], device="cuda", dtype="float32")
    ids = ref.tokenizer.encode("def add(a, b):")
    want = list(ref.generate_ids(ids, params))
    llm = LLM(str(files[file_type]), device="cuda", dtype="float32")
    got = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
