"""Parameter counts: equal to the tensor sizes of tiny transformers models built from the same config, and within
0.5% of the published totals of the preset shapes."""
import json

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from brrr.analysis.model import matrices, param_counts, weight_bytes
from brrr.config import ModelConfig
from brrr.presets import PRESETS, preset_config

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)

# name -> (transformers config class, model class, overrides)
FAMILIES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama-tied-biases": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "mixtral-moe": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe-shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(MOE, num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3-moe-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(MOE, num_experts=4, decoder_sparse_step=2, head_dim=24)),
    "deepseek-v3-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(**MOE, **MLA, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                             q_lora_rank=48, n_group=2, topk_group=1)),
    "deepseek-v2-mla-no-q-lora": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                                  dict(**MOE, **MLA, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1,
                                       q_lora_rank=None)),
}


def hf_model(family: str, tmp_path, **overrides):
    """A tiny random transformers model and brrr's ModelConfig parsed from the config.json it saves."""
    config_cls, model_cls, fam = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **fam, **overrides}, architectures=[model_cls])
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    config.save_pretrained(tmp_path)
    return model, ModelConfig.from_dir(tmp_path)


def tensor_sizes(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("family", FAMILIES)
def test_total_equals_sum_of_tensor_sizes(family, tmp_path):
    model, cfg = hf_model(family, tmp_path)
    counts = param_counts(cfg)
    assert counts["total"] == tensor_sizes(model)
    assert counts["total"] == sum(counts[k] for k in ("embedding", "attention", "mlp", "norms", "head"))


@pytest.mark.parametrize("family", ["mixtral-moe", "qwen2-moe-shared", "qwen3-moe-sparse-step", "deepseek-v3-mla"])
def test_moe_active_params_count_k_experts_per_layer(family, tmp_path):
    model, cfg = hf_model(family, tmp_path)
    # routed expert weights are the 3-D gate_up_proj / down_proj tensors: [experts, out, in]
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    counts = param_counts(cfg)
    assert counts["routed_experts"] == routed
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    assert counts["active"] == tensor_sizes(model) - routed * (e - k) // e


def test_tied_head_is_not_counted_twice(tmp_path):
    model, cfg = hf_model("llama-tied-biases", tmp_path)
    counts = param_counts(cfg)
    assert counts["head"] == 0 and counts["embedding"] == 128 * 64
    untied = ModelConfig.from_hf({**json.loads((tmp_path / "config.json").read_text()), "tie_word_embeddings": False})
    assert param_counts(untied)["total"] == counts["total"] + 128 * 64


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 4), group=st.sampled_from([1, 2]), head_dim=st.sampled_from([8, 16]),
       layers=st.integers(1, 3), inter=st.integers(1, 64), vocab=st.integers(8, 100), tied=st.booleans(),
       bias=st.booleans())
def test_llama_counts_match_transformers_for_any_shape(heads, group, head_dim, layers, inter, vocab, tied, bias):
    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=heads * group, num_key_value_heads=heads,
                                      head_dim=head_dim, num_hidden_layers=layers, intermediate_size=inter,
                                      vocab_size=vocab, tie_word_embeddings=tied, attention_bias=bias,
                                      architectures=["LlamaForCausalLM"])
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = transformers.LlamaForCausalLM(config)
    assert param_counts(ModelConfig.from_hf(config.to_dict()))["total"] == tensor_sizes(model)


# Published totals (model cards / papers). Llama-3.1-8B "8.03B" and Llama-2-7B "6.74B" are the ones the issue names.
PUBLISHED = {"llama-3.1-8b": 8.03e9, "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-3.2-1b": 1.24e9,
             "qwen3-8b": 8.19e9, "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9, "deepseek-v3": 671e9,
             "deepseek-v2-lite": 15.7e9}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_totals_within_half_a_percent(name):
    assert param_counts(preset_config(name))["total"] == pytest.approx(PUBLISHED[name], rel=0.005)


def test_exact_preset_totals_by_hand():
    # Llama-3.1-8B: embedding = head = 128256 * 4096 = 525,336,576.
    # per layer: q 4096*4096 + k 4096*1024 + v 4096*1024 + o 4096*4096 = 41,943,040;
    #            MLP 3 * 4096 * 14336 = 176,160,768; two norms 8,192  -> 218,112,000
    # total = 32 * 218,112,000 + 4,096 (final norm) + 2 * 525,336,576 = 8,030,261,248
    assert param_counts(preset_config("llama-3.1-8b"))["total"] == 8_030_261_248
    # Llama-2-7B: embedding = head = 32000 * 4096 = 131,072,000; per layer 4 * 4096^2 = 67,108,864 (MHA)
    # + 3 * 4096 * 11008 = 135,266,304 + 8,192 = 202,383,360; total 32 * that + 4,096 + 262,144,000
    assert param_counts(preset_config("llama-2-7b"))["total"] == 6_738_415_616
    # Mixtral-8x7B: per layer attention 41,943,040, each expert 3 * 4096 * 14336 = 176,160,768, router
    # 8 * 4096 = 32,768, norms 8,192. Total per layer with 8 experts 1,451,270,144; active (2 experts)
    # 394,305,536. Plus 4,096 + 2 * 32000 * 4096 = 262,148,096 outside the layers.
    mixtral = param_counts(preset_config("mixtral-8x7b"))
    assert mixtral["total"] == 32 * 1_451_270_144 + 262_148_096 == 46_702_792_704
    assert mixtral["active"] == 32 * 394_305_536 + 262_148_096 == 12_879_925_248
    # Llama-3.2-1B and Qwen3-0.6B tie their head to the embedding: no head parameters.
    assert param_counts(preset_config("llama-3.2-1b"))["head"] == 0
    assert param_counts(preset_config("qwen3-0.6b"))["total"] == 596_049_920
    # DeepSeek-V3: 37.55B active of 671.03B (the paper's "37B activated")
    v3 = param_counts(preset_config("deepseek-v3"))
    assert v3["active"] == pytest.approx(37.55e9, rel=1e-3)


def test_weight_bytes_per_format_by_hand():
    cfg = preset_config("llama-3.1-8b")
    linear = sum(m.size * m.count for m in matrices(cfg))  # 7,504,658,432: all but the embedding and norms
    assert linear == 8_030_261_248 - 525_336_576 - 266_240
    assert weight_bytes(cfg, "bf16") == 2 * 8_030_261_248
    assert weight_bytes(cfg, "fp32") == 4 * 8_030_261_248
    # int4 g128: half a byte per weight + 4 bytes (bf16 scale + zero) per 128 weights = 0.53125 bytes per weight;
    # every input dim (4096, 14336) is a multiple of 128. Embedding and norms stay bf16.
    assert weight_bytes(cfg, "int4") == linear * 0.53125 + (525_336_576 + 266_240) * 2
    # int8: one byte per weight + a bf16 scale per output row; fp8 one 4-byte scale per matrix: per layer
    # q, k, v, o, fused gate_up, down (6 x 32) + the head
    rows = sum(m.rows * m.count for m in matrices(cfg))
    assert weight_bytes(cfg, "int8") == linear + 2 * rows + (525_336_576 + 266_240) * 2
    assert weight_bytes(cfg, "fp8") == linear + 4 * (6 * 32 + 1) + (525_336_576 + 266_240) * 2


def test_every_preset_parses_and_counts():
    for name in PRESETS:
        counts = param_counts(preset_config(name))
        assert 0 < counts["active"] <= counts["total"]
