"""LoRA / QLoRA fine-tuning arithmetic: adapter parameters, FLOPs per token and the memory of one GPU
(docs/finetuning.md derives each term).

Frozen base: bf16, 2 bytes per parameter; QLoRA stores every decoder projection in NF4 with double quantization,
NF4_BYTES_PER_PARAM = 1/2 (a 4-bit code) + 1/64 (one int8 absmax per block of 64) + 4/(64 * 256) (one fp32 scale per
256 absmaxes) = 0.5159 bytes, while embeddings, norms and the LM head stay bf16. Only the adapters train:
ADAPTER_BYTES_PER_PARAM = 16 (fp32 weight, fp32 gradient, fp32 Adam m and v). Activations as in full training
(brrr.analysis.train), plus per adapted module its rank-r intermediate and, with dropout, the dropped input and its
mask; the loss is the chunked linear cross-entropy (brrr/train/loss.py: one chunk of logits at a time, the hidden
states' gradient computed with it, the frozen head's none), as in full training (brrr.analysis.train.loss_bytes).
"""
from __future__ import annotations

from brrr.analysis.model import param_counts, prefill_flops_per_token
from brrr.analysis.train import activation_bytes_per_token_per_layer, loss_bytes
from brrr.config import ModelConfig
from brrr.errors import BrrrError

# NF4's blocks (brrr/quant/formats.py stores with these): one absmax per NF4_BLOCK weights, one fp32 scale per
# NF4_SCALE_BLOCK int8 absmaxes. Here, torch-free, so calc reads them without importing the format code.
NF4_BLOCK, NF4_SCALE_BLOCK = 64, 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALE_BLOCK)
ADAPTER_BYTES_PER_PARAM = 16
CHECKPOINTING = ("full", "selective", "none")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder projection of a Llama-family layer."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def _targets(cfg: ModelConfig, targets) -> dict[str, tuple[int, int]]:
    shapes = projection_shapes(cfg)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise BrrrError(f"--target-modules: {', '.join(unknown)} not among {', '.join(shapes)}")
    return {t: shapes[t] for t in targets}


def adapter_params(cfg: ModelConfig, r: int, targets=DEFAULT_TARGETS, dora: bool = False) -> int:
    """r (in + out) per adapted projection per layer (+ out for DoRA's magnitude)."""
    if r < 1:
        raise BrrrError(f"--lora-r must be >= 1, got {r}")
    per_layer = sum(r * (i + o) + (o if dora else 0) for o, i in _targets(cfg, targets).values())
    return per_layer * cfg.num_layers


def lora_training_flops_per_token(cfg: ModelConfig, seq_len: int, lora=None, recompute: bool = False) -> float:
    """Forward (2N + attention) + backward to the inputs only (2N + 2 x attention): a frozen weight gets no
    gradient GEMM, so LoRA does about 4N where full training does 6N; + 6 per adapter parameter; + one forward
    when recomputing."""
    forward = prefill_flops_per_token(cfg, seq_len)
    attention = forward - prefill_flops_per_token(cfg, 1)
    dense = forward - attention
    adapters = 0 if lora is None else 6 * adapter_params(cfg, lora.r, _names(lora.target_modules), lora.use_dora)
    return (2 if recompute else 1) * forward + dense + 2 * attention + adapters


def _names(targets) -> tuple:
    """Projection kinds of a LoraConfig's target_modules (a regular expression: counted as all of them)."""
    if isinstance(targets, str):
        return DEFAULT_TARGETS
    return tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))


def finetune_memory(cfg: ModelConfig, r: int = 16, targets=DEFAULT_TARGETS, qlora: bool = False,
                    dora: bool = False, dropout: bool = True, micro_batch: int = 1, seq_len: int = 2048,
                    checkpointing: str = "full") -> dict:
    """Bytes on one GPU while fine-tuning: frozen base, adapters (+ grads + Adam), activations, logits chunk, and
    for QLoRA the one dequantized bf16 projection that exists at a time (forward or backward).
    checkpointing: full (each layer keeps its input, one layer is rematerialized at a time), selective (each layer
    also keeps its wide matmul outputs, attention's output and log-sum-exp, and the rank-r LoRA outputs) or none."""
    if checkpointing not in CHECKPOINTING:
        raise BrrrError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    if micro_batch < 1 or seq_len < 1:
        raise BrrrError(f"--micro-batch ({micro_batch}) and --seq-len ({seq_len}) must be >= 1")
    shapes = _targets(cfg, targets)
    all_shapes = projection_shapes(cfg)
    proj_params = cfg.num_layers * sum(o * i for o, i in all_shapes.values())
    other_params = param_counts(cfg)["total"] - proj_params
    base = other_params * 2 + proj_params * (NF4_BYTES_PER_PARAM if qlora else 2)
    n_adapter = adapter_params(cfg, r, targets, dora)
    tokens = micro_batch * seq_len
    h = cfg.hidden_size
    # per token per layer, beyond full training's saved activations: each adapter's rank-r output (bf16), and with
    # dropout the dropped input (bf16) and its mask (1 byte) per adapted module
    lora_extra = sum(2 * r + (3 * i if dropout else 0) for o, i in shapes.values())
    full_layer = (activation_bytes_per_token_per_layer(cfg) + lora_extra) * tokens
    if checkpointing == "none":
        activations = cfg.num_layers * full_layer
    else:
        kept = 2 * h
        if checkpointing == "selective":
            kept += 2 * sum(o for o, i in all_shapes.values()) + 2 * r * len(shapes)
            kept += 2 * cfg.num_heads * cfg.head_dim + 4 * cfg.num_heads
        activations = cfg.num_layers * kept * tokens + full_layer
    loss = loss_bytes(cfg, tokens, head_trains=False)
    logits = loss["transient"] + loss["gradients"]
    dequantized = 2 * max(o * i for o, i in all_shapes.values()) if qlora else 0
    total = base + ADAPTER_BYTES_PER_PARAM * n_adapter + activations + logits + dequantized
    return {"base_weights": base, "adapter_params": n_adapter, "adapter_weights": 4 * n_adapter,
            "adapter_grads": 4 * n_adapter, "optimizer": 8 * n_adapter, "activations": activations,
            "logits": logits, "dequantized_weight": dequantized, "total": total,
            "base_bytes_per_projection_param": NF4_BYTES_PER_PARAM if qlora else 2, "checkpointing": checkpointing}
