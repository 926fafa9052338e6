"""GGUF files read by brrr against transformers reading the same file (its GGUF loader is the oracle)."""
import pytest
import torch
import transformers

import brrr
from brrr.engine import LLM
from brrr.kernels import AttnMeta
from brrr.quant.linear import QuantLinear
from brrr.sampling_params import SamplingParams
from tests.gguf.conftest import TEXT

# logits tolerance per type: F32 reads the same numbers (only op order differs); the quantized types dequantize to
# the same numbers transformers does, so the same bound holds for them
TOL = {"f32": 1e-4, "f16": 1e-4, "q8_0": 1e-4, "q4_0": 1e-4, "q4_k_m": 1e-4, "q6_k": 1e-4}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _logits(model, ids):
    n = len(ids)
    with torch.no_grad():
        return model.logits(torch.tensor(ids), torch.arange(n), AttnMeta.causal([n], "cpu"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "tied"])
@pytest.mark.parametrize("file_type", ["f32", "f16", "q8_0", "q4_0", "q4_k_m", "q6_k"])
def test_logits_match_transformers_reading_the_same_file(gguf_file, family, file_type):
    path = gguf_file(family, file_type)
    mine = brrr.load(path, device="cpu")
    ids = mine.tokenizer.encode(TEXT)
    with torch.no_grad():
        want = _hf(path)(torch.tensor([ids])).logits[0]
    got = _logits(mine.model, ids)
    assert (got - want).abs().max().item() <= TOL[file_type]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # every quantized projection keeps its codes: Q4_0 as int4, the rest group-wise (at hidden 64 the exporter writes
    # Q8_0 for rows shorter than a K-quant super-block; Qwen3's 512-wide o_proj rows hold two);
    # tests/gguf/test_groupwise_load.py holds each format to the dequantized model
    repacked = [m for m in mine.model.modules() if isinstance(m, QuantLinear)]
    assert len(repacked) == (0 if file_type in ("f32", "f16") else 14)
    assert {m.fmt for m in repacked} <= {"q4_0": {"int4"}, "q8_0": {"q8_0"}, "q4_k_m": {"q8_0", "q4_k", "q6_k"},
                                         "q6_k": {"q8_0", "q6_k"}}.get(file_type, set())
    assert mine.model.gguf_fallback == ()


def test_mistral_keeps_its_sliding_window(gguf_file, hf_dir):
    """transformers reads a llama-architecture file without its sliding window; the original checkpoint is the
    oracle for a prompt longer than the window (16)."""
    path = gguf_file("mistral", "f32")
    _, original = hf_dir("mistral")
    mine = brrr.load(path, device="cpu")
    assert mine.config.sliding_window == 16 and mine.config.architecture == "MistralForCausalLM"
    ids = mine.tokenizer.encode(TEXT)
    assert len(ids) > 16
    with torch.no_grad():
        want = original(torch.tensor([ids])).logits[0]
    assert (_logits(mine.model, ids) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("file_type", ["f16", "q4_0"])
def test_greedy_tokens_through_load_and_the_paged_engine(gguf_file, file_type):
    path = gguf_file("llama", file_type)
    hf = _hf(path)
    mine = brrr.load(path, device="cpu")
    ids = mine.tokenizer.encode("Hello, world!")
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert list(mine.generate_ids(ids, params)) == want.tolist()
    llm = LLM(str(path), device="cpu", num_blocks=32, block_size=16)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want.tolist()


def test_q4_0_repack_equals_the_dequantized_reference(gguf_file):
    from brrr.gguf.load import load_gguf_model

    path = gguf_file("qwen2", "q4_0")
    packed = load_gguf_model(path, torch.float32, torch.device("cpu"), repack=True)
    plain = load_gguf_model(path, torch.float32, torch.device("cpu"), repack=False)
    q = packed.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.fmt == "int4" and q.group_size == 32
    assert torch.equal(q.dequantize(), plain.model.layers[0].self_attn.q_proj.weight)
    ids = list(range(3, 40))
    assert torch.allclose(_logits(packed, ids), _logits(plain, ids), atol=1e-5)


@pytest.mark.parametrize("family, rope", [("llama3-rope", "llama3"), ("llama-linear-rope", "linear"),
                                          ("llama-yarn-rope", "yarn")])
def test_rope_scaling_survives_the_file(tmp_path, family, rope):
    """llama.cpp keeps linear/yarn as rope.scaling.* keys and Llama 3's as rope_freqs.weight divisors; transformers'
    GGUF reader drops both, so the original checkpoint is the oracle."""
    from brrr.gguf.export import export_gguf
    from tests import hf_models

    model = hf_models.build(family, vocab_size=320)
    hf_models.save(model, tmp_path)
    hf_models.save_tokenizer(tmp_path)
    export_gguf(tmp_path, tmp_path / "r.gguf", "f32")
    mine = brrr.load(tmp_path / "r.gguf", device="cpu")
    assert mine.config.rope.type == rope
    ids = list(range(3, 90))  # past llama3's original 32 and yarn's 64 positions
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert (_logits(mine.model, ids) - want).abs().max().item() < 1e-4


def test_a_rope_without_a_gguf_form_is_refused(tmp_path):
    from brrr.errors import BrrrError
    from brrr.gguf.export import export_gguf
    from tests import hf_models

    hf_models.save(hf_models.build("llama-dynamic-rope", vocab_size=320), tmp_path)
    hf_models.save_tokenizer(tmp_path)
    with pytest.raises(BrrrError, match="rope type 'dynamic'"):
        export_gguf(tmp_path, tmp_path / "d.gguf", "f32")


def test_bf16_load_of_a_q4_0_file(gguf_file):
    path = gguf_file("llama", "q4_0")
    ids = list(range(3, 40))
    want = _logits(brrr.load(path, device="cpu").model, ids)
    got = _logits(brrr.load(path, device="cpu", dtype="bfloat16").model, ids).float()
    assert ((got - want).norm() / want.norm()).item() < 5e-2
