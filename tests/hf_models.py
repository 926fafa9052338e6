"""Tiny random Hugging Face models for parity tests, built with transformers and saved with save_pretrained."""
import torch
import transformers

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256, initializer_range=0.1)

# name -> (config class, model class, overrides)
FAMILIES = {
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "llama-dynamic-rope": ("LlamaConfig", "LlamaForCausalLM", dict(max_position_embeddings=32, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-yarn-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "head-dim-32": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32)),
    "llama-attn-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
}

# Mixture-of-experts and latent-attention families (tests/test_moe_parity.py). transformers v5 holds their experts
# fused in memory, so their state_dict names differ from the checkpoint's; the parity test compares files instead.
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            moe_intermediate_size=32, first_k_dense_replace=1)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
             mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[0])),
    "qwen3-moe-norm-topk": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16,
        num_hidden_layers=3, decoder_sparse_step=2)),
    "deepseek-v2-group-limited": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _MLA, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=None, n_shared_experts=2,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "deepseek-v2-lite-yarn": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _MLA, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=24, n_shared_experts=1, rope_parameters=_YARN)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _MLA, n_routed_experts=8, num_experts_per_tok=3, q_lora_rank=24, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, rope_parameters=_YARN)),
}


def build(family: str, **overrides):
    config_cls, model_cls, fam = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **fam, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # DeepSeek-V3's balancing bias starts at zero; a random one makes it matter
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    return model


def save(model, path, sharded=False):
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "10GB")
    return path


def save_tokenizer(path, vocab=300, chat_template=None):
    """A byte-level BPE tokenizer trained on a little local text, saved the way transformers saves one."""
    from brrr.train.tokenizer import CHAT_TEMPLATE, build_tokenizer

    text = ["def add(a, b):\n    return a + b\n", "Hello, world! The quick brown fox jumps over the lazy dog."] * 20
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(text, vocab), bos_token="<|bos|>",
                                              eos_token="<|eos|>", pad_token="<|pad|>")
    hf.chat_template = chat_template or CHAT_TEMPLATE
    hf.save_pretrained(path)
    return path
