"""Adds a "1B" flavor (the shape of brrr's preset llama-3.2-1b) to torchtitan 0.2.2's llama3 model registry.

Loaded by torchtitan through `--experimental.custom_import brrr_titan_flavors` before it looks the flavor up.
torchtitan's llama3 model has no weight tying, so its 1B keeps a separate LM head (1.50B parameters against the
1.24B of the tied Llama-3.2-1B); the matmul FLOPs per token are the same either way.
"""
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

# ffn hidden: 2/3 * 4 * 2048 = 5461, x 1.5 = 8191, rounded up to a multiple of 1024 = 8192 (Llama-3.2-1B's)
llama3_args["1B"] = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024,
    rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0))
