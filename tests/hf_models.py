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


def build(family: str, **overrides):
    config_cls, model_cls, fam = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **fam, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


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
