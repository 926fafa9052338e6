"""Published model shapes, as their Hugging Face config.json files have them.

`brrr calc` (and anything else that needs a real shape without downloading weights) takes a preset name
wherever it takes a model directory. The dicts are the config.json files of the named checkpoints on the
Hugging Face hub, trimmed to the fields a config parser reads (training-only flags such as
initializer_range, attention_dropout, pretraining_tp and use_cache are left out).
"""
from __future__ import annotations

from brrr.config import ModelConfig
from brrr.errors import BrrrError

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-05}
_LLAMA3_BASE = {**_LLAMA, "bos_token_id": 128000, "eos_token_id": 128001, "vocab_size": 128256,
                "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
_LLAMA2_BASE = {**_LLAMA, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 32000,
                "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
                "tie_word_embeddings": False, "torch_dtype": "float16"}
_QWEN3_BASE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
               "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
               "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
               "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
               "vocab_size": 151936, "torch_dtype": "bfloat16"}

PRESETS: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {**_LLAMA3_BASE, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                     "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # meta-llama/Llama-3.2-1B (input embedding and LM head share one matrix)
    "llama-3.2-1b": {**_LLAMA3_BASE, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "tie_word_embeddings": True,
                     "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    # HuggingFaceTB/SmolLM2-135M (deep and thin: 30 layers of width 576; tied embeddings)
    "smollm2-135m": {**_LLAMA, "bos_token_id": 0, "eos_token_id": 0, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rope_scaling": None,
                     "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152},
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": {**_LLAMA2_BASE, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    # meta-llama/Llama-2-13b-hf
    "llama-2-13b": {**_LLAMA2_BASE, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40},
    # meta-llama/Llama-2-70b-hf (grouped-query attention: 64 query heads share 8 KV heads)
    "llama-2-70b": {**_LLAMA2_BASE, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    # Qwen/Qwen3-0.6B (tied embeddings; head_dim 128 although hidden/heads = 64)
    "qwen3-0.6b": {**_QWEN3_BASE, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "max_window_layers": 28,
                   "tie_word_embeddings": True},
    # Qwen/Qwen3-8B
    "qwen3-8b": {**_QWEN3_BASE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36,
                 "tie_word_embeddings": False},
    # mistralai/Mistral-7B-v0.1 (sliding-window attention over the last 4,096 tokens)
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                   "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 4096, "intermediate_size": 14336,
                   "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                   "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "vocab_size": 32000},
    # mistralai/Mixtral-8x7B-v0.1 (8 experts per layer, 2 active per token)
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
                     "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 4096, "intermediate_size": 14336,
                     "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                     "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                     "torch_dtype": "bfloat16", "vocab_size": 32000},
    # Qwen/Qwen3-30B-A3B (128 experts of width 768 per layer, 8 active per token, renormalized)
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
                      "attention_bias": False, "bos_token_id": 151643, "decoder_sparse_step": 1,
                      "eos_token_id": 151645, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
                      "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                      "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                      "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "use_sliding_window": False, "vocab_size": 151936},
    # deepseek-ai/DeepSeek-V3 (multi-head latent attention; 256 routed + 1 shared expert, 8 routed per token;
    # the first 3 layers dense; the checkpoint's extra multi-token-prediction layer is not part of this shape)
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
                    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
                    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
                    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
                    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
                    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "rms_norm_eps": 1e-06, "rope_theta": 10000,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
                    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
                    "vocab_size": 129280},
    # deepseek-ai/DeepSeek-V2-Lite (MLA without a query low-rank projection; 64 routed + 2 shared experts)
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
                         "attention_bias": False, "bos_token_id": 100000, "eos_token_id": 100001,
                         "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 10944,
                         "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
                         "moe_layer_freq": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
                         "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
                         "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
                         "qk_rope_head_dim": 64,
                         "rms_norm_eps": 1e-06, "rope_theta": 10000,
                         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
                         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "v_head_dim": 128,
                         "vocab_size": 102400},
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset shape, e.g. preset_config("llama-3.1-8b")."""
    if name not in PRESETS:
        raise BrrrError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig.from_hf(PRESETS[name], source=f"preset {name}")
