"""ModelConfig: the one description of a model, parsed from a Hugging Face config.json; EngineConfig: how the
serving engine sizes and schedules itself, with its speculative (speculative.py) and disaggregation
(disaggregation.py) parts. Nothing here imports another brrr package but errors and brrr.gguf's metadata reader
(a GGUF file is a config too): every layer reads its configs."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from brrr.config.disaggregation import check_combination, parse_disaggregate
from brrr.config.speculative import SpeculativeConfig
from brrr.errors import BrrrError
from brrr.gguf.config import hf_config as gguf_hf_config
from brrr.gguf.reader import is_gguf, open_gguf

# Architectures brrr runs, and the family file that implements each.
RUNNABLE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    # the Llama family's attention with a mixture-of-experts MLP (brrr/models/moe.py) on its sparse layers
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    # with multi-head latent attention (brrr/models/mla.py)
    "DeepseekV2ForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "llama",
}
# Architectures brrr can describe (calc, bench arithmetic) but not yet run.
DESCRIBED_ARCHITECTURES: set[str] = set()
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                "Qwen2MoeForCausalLM": "qwen2_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                "DeepseekV3ForCausalLM": "deepseek_v3"}
# How an MoE router turns its logits into each token's experts and weights (brrr/kernels/moe_routing.py):
# softmax then top-k (Mixtral, Qwen-MoE; DeepSeek-V2's "greedy"), softmax top-k within the best groups
# (DeepSeek-V2's "group_limited_greedy"), sigmoid plus a balancing bias within the best groups (V3's "noaux_tc").
ROUTER_SCORINGS = ("softmax", "softmax_group_limited", "sigmoid_grouped")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeConfig:
    type: str = "default"
    theta: float = 10000.0
    params: dict = field(default_factory=dict)  # factor, low/high_freq_factor, original_max_position_embeddings, ...

    def __hash__(self):
        return hash((self.type, self.theta, tuple(sorted(self.params.items()))))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama when configured)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Mixture-of-experts shape (described for arithmetic; not runnable yet).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # DeepSeek's always-on experts, each moe_intermediate_size wide
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's one gated shared expert
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP
    router_scoring: str = "softmax"  # one of ROUTER_SCORINGS
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1 (Mixtral always does)
    routed_scaling_factor: float = 1.0  # DeepSeek: the routed experts' weights are multiplied by it
    n_group: int = 1  # DeepSeek's grouped top-k: experts form n_group groups, tokens pick topk_group of them
    topk_group: int = 1
    router_aux_loss_coef: float = 0.0  # training: the load-balancing loss's weight (transformers' name)
    # Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0 means the KV cache holds a
    # kv_lora_rank latent plus a qk_rope_head_dim shared rotary key per token per layer.
    q_lora_rank: int = 0  # 0: queries come from one hidden -> heads * (nope + rope) projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # MLA: the rotary half of q/k is laid out in interleaved pairs (DeepSeek's)

    @property
    def family(self) -> str:
        return RUNNABLE_ARCHITECTURES[self.architecture]

    @property
    def max_context(self) -> int:
        """Longest sequence the model is meant to see; dynamic NTK RoPE stretches max_position_embeddings by factor."""
        if self.rope.type == "dynamic":
            return int(self.max_position_embeddings * self.rope.params["factor"])
        return self.max_position_embeddings

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """The paged KV cache per token and layer: (heads, key width, value width). MLA caches one latent row,
        kv_lora_rank + qk_rope_head_dim, and no separate values (they are the latent's first kv_lora_rank)."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def runnable(self) -> bool:
        return self.architecture in RUNNABLE_ARCHITECTURES

    def to_dict(self) -> dict:
        return asdict(self)

    def to_hf(self) -> dict:
        """An HF config.json for this shape (what save_model writes, and what transformers loads)."""
        rope = {"rope_type": self.rope.type, "rope_theta": self.rope.theta, **self.rope.params}
        out = {
            "architectures": [self.architecture], "model_type": _MODEL_TYPES.get(self.architecture, "llama"),
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta, "rope_parameters": rope, "rope_scaling": None if self.rope.type == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "hidden_act": "silu", "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.torch_dtype,
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        return {**out, **self._moe_mla_hf()}

    def _moe_mla_hf(self) -> dict:
        """The mixture-of-experts and latent-attention fields of to_hf, under each architecture's names."""
        if not self.num_experts:
            return {}
        dense, arch = list(self.dense_mlp_layers), self.architecture
        moe = {"num_experts_per_tok": self.num_experts_per_tok, "router_aux_loss_coef": self.router_aux_loss_coef}
        if arch == "MixtralForCausalLM":
            return {**moe, "num_local_experts": self.num_experts}
        moe.update(moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob)
        if arch.startswith("Qwen"):
            return {**moe, "num_experts": self.num_experts, "mlp_only_layers": dense, "decoder_sparse_step": 1,
                    "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if dense != list(range(len(dense))):
            raise BrrrError(f"{arch}: dense MLP layers {dense} are not the first k layers (first_k_dense_replace)")
        method = {"softmax": "greedy", "softmax_group_limited": "group_limited_greedy", "sigmoid_grouped": "noaux_tc"}
        return {**moe, "n_routed_experts": self.num_experts, "n_shared_experts": self.num_shared_experts,
                "first_k_dense_replace": len(dense), "topk_method": method[self.router_scoring],
                "n_group": self.n_group, "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor, "q_lora_rank": self.q_lora_rank or None,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                "rope_interleave": self.rope_interleave,
                "head_dim": self.qk_rope_head_dim}  # transformers' DeepSeek configs: the rotary width

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if is_gguf(path):  # a GGUF file carries its config as metadata
            return cls.from_hf(gguf_hf_config(open_gguf(path)), source=str(path))
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise BrrrError(f"config.json not found: {file}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise BrrrError(f"{file} is not valid JSON: {e}") from None
        return cls.from_hf(raw, source=str(file))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise BrrrError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        get = _Getter(raw, source)
        archs = get("architectures", list)
        if not archs or not isinstance(archs[0], str):
            raise BrrrError(f"{source}: field 'architectures' must be a non-empty list of names")
        arch = archs[0]
        if arch not in RUNNABLE_ARCHITECTURES and arch not in DESCRIBED_ARCHITECTURES:
            known = ", ".join(sorted(RUNNABLE_ARCHITECTURES))
            raise BrrrError(f"{source}: field 'architectures' names {arch!r}, which brrr does not support (supported: {known})")
        hidden = get("hidden_size", int, positive=True)
        heads = get("num_attention_heads", int, positive=True)
        kv_heads = get("num_key_value_heads", int, default=heads, positive=True)
        if heads % kv_heads:
            raise BrrrError(f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = get("head_dim", int, default=None, positive=True) or hidden // heads
        if head_dim % 2:
            raise BrrrError(f"{source}: field 'head_dim' must be even for rotary embeddings, got {head_dim}")
        if get("kv_lora_rank", int, default=0):
            # MLA: every head gets its own key of qk_nope + qk_rope expanded from the latent (num_key_value_heads
            # and head_dim, where a config has them, describe the latent's rotary part, not the heads)
            kv_heads = heads
            head_dim = get("qk_nope_head_dim", int, default=0) + get("qk_rope_head_dim", int, default=0) or head_dim
        max_pos = get("max_position_embeddings", int, default=4096, positive=True)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        use_sw = get("use_sliding_window", bool, default=not arch.startswith("Qwen"))
        if use_sw and arch.startswith("Qwen"):
            raise BrrrError(f"{source}: field 'use_sliding_window' is true; brrr does not run Qwen's per-layer sliding window yet")
        sliding_window = get("sliding_window", int, default=None, positive=True) if use_sw else None
        eos = raw.get("eos_token_id")
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise BrrrError(f"{source}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=get("num_hidden_layers", int, positive=True),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size", int, positive=True),
            vocab_size=get("vocab_size", int, positive=True),
            max_position_embeddings=max_pos,
            rope=_parse_rope(raw, get, max_pos, source),
            rms_norm_eps=get("rms_norm_eps", float, default=1e-6, positive=True),
            tie_word_embeddings=get("tie_word_embeddings", bool, default=False),
            attention_bias=True if is_qwen2 else get("attention_bias", bool, default=False),
            o_proj_bias=False if is_qwen2 else get("attention_bias", bool, default=False),
            mlp_bias=get("mlp_bias", bool, default=False),
            qk_norm=arch.startswith("Qwen3"),
            sliding_window=sliding_window,
            bos_token_id=get("bos_token_id", int, default=None),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            num_experts=(get("num_local_experts", int, default=None) or get("num_experts", int, default=None)
                         or get("n_routed_experts", int, default=0)),
            num_experts_per_tok=get("num_experts_per_tok", int, default=0),
            moe_intermediate_size=get("moe_intermediate_size", int, default=0),
            num_shared_experts=get("n_shared_experts", int, default=0),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", int, default=0),
            dense_mlp_layers=_dense_mlp_layers(get),
            q_lora_rank=get("q_lora_rank", int, default=0),
            kv_lora_rank=get("kv_lora_rank", int, default=0),
            qk_nope_head_dim=get("qk_nope_head_dim", int, default=0),
            qk_rope_head_dim=get("qk_rope_head_dim", int, default=0),
            v_head_dim=get("v_head_dim", int, default=0),
            rope_interleave=get("rope_interleave", bool, default=True),
            **_router_fields(arch, get, source),
        )


def _router_fields(arch: str, get: "_Getter", source: str) -> dict:
    """The router's rule, read the way transformers' modeling code reads it for each architecture."""
    out = dict(router_aux_loss_coef=get("router_aux_loss_coef", float, default=0.0))
    if arch == "MixtralForCausalLM":
        return dict(out, norm_topk_prob=True)  # Mixtral always renormalizes its top-k
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return dict(out, norm_topk_prob=get("norm_topk_prob", bool, default=False))
    if not arch.startswith("Deepseek"):
        return out
    if arch == "DeepseekV3ForCausalLM":
        scoring, norm = "sigmoid_grouped", get("norm_topk_prob", bool, default=True)
    else:  # transformers' V2 router ignores norm_topk_prob
        method = get("topk_method", str, default="greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise BrrrError(f"{source}: field 'topk_method' is {method!r}; DeepseekV2 supports greedy, group_limited_greedy")
        scoring, norm = ("softmax" if method == "greedy" else "softmax_group_limited"), False
    experts = get("n_routed_experts", int, default=0)
    n_group = get("n_group", int, default=1, positive=True)
    topk_group = get("topk_group", int, default=1, positive=True)
    if scoring != "softmax":
        if experts % n_group:
            raise BrrrError(f"{source}: field 'n_group' ({n_group}) must divide n_routed_experts ({experts})")
        if topk_group > n_group:
            raise BrrrError(f"{source}: field 'topk_group' ({topk_group}) must be <= n_group ({n_group})")
        per_group = experts // n_group
        top_k = get("num_experts_per_tok", int, default=0)
        if scoring == "sigmoid_grouped" and per_group < 2:
            raise BrrrError(f"{source}: field 'n_group' ({n_group}) leaves {per_group} expert per group; the "
                            f"sigmoid router scores a group by its best two, so n_routed_experts / n_group must be >= 2")
        if top_k > topk_group * per_group:
            raise BrrrError(f"{source}: field 'num_experts_per_tok' ({top_k}) exceeds the experts of topk_group "
                            f"({topk_group}) groups of {per_group}")
    return dict(out, router_scoring=scoring, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=get("routed_scaling_factor", float, default=1.0))


def _dense_mlp_layers(get: "_Getter") -> tuple[int, ...]:
    """Layers of an MoE model with a dense MLP: DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers
    and the layers decoder_sparse_step skips (transformers' rule: layer i is sparse iff (i + 1) % step == 0)."""
    if not (get("num_local_experts", int, default=0) or get("num_experts", int, default=0)
            or get("n_routed_experts", int, default=0)):
        return ()
    first_dense = get("first_k_dense_replace", int, default=0)
    only = get("mlp_only_layers", list, default=[])
    step = get("decoder_sparse_step", int, default=1, positive=True)
    layers = get("num_hidden_layers", int, positive=True)
    return tuple(i for i in range(layers) if i < first_dense or i in only or (i + 1) % step)


class _Getter:
    """Reads a typed field from the raw config; every error names the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def __call__(self, name, typ, default=..., positive=False):
        if name not in self.raw or self.raw[name] is None:
            if default is ...:
                raise BrrrError(f"{self.source}: required field {name!r} is missing")
            return default
        value = self.raw[name]
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise BrrrError(f"{self.source}: field {name!r} must be {typ.__name__}, got {type(value).__name__} {value!r}")
        if positive and value <= 0:
            raise BrrrError(f"{self.source}: field {name!r} must be > 0, got {value!r}")
        return value


def _parse_rope(raw: dict, get: _Getter, max_pos: int, source: str) -> RopeConfig:
    # transformers <5 writes rope_theta + rope_scaling; >=5 writes rope_parameters (with rope_theta inside).
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    field_name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise BrrrError(f"{source}: field {field_name!r} must be an object, got {params!r}")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise BrrrError(f"{source}: field '{field_name}.rope_type' is {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = get("rope_theta", float, default=10000.0, positive=True)
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise BrrrError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if not isinstance(params.get(key), (int, float)) or isinstance(params.get(key), bool):
            raise BrrrError(f"{source}: field '{field_name}.{key}' is required for rope type {rope_type!r} and must be a number")
    params = {k: v for k, v in params.items() if v is not None}
    return RopeConfig(type=rope_type, theta=float(theta), params=params)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_EVICTIONS = ("streaming", "snapkv", "h2o")
# the policies that compact a prompt's rows in place (its blocks are rewritten): no prefix caching for them
COMPACTING_EVICTIONS = ("snapkv", "h2o")
SNAPKV_WINDOW = 32  # SnapKV's observation window: the last prompt queries whose attention scores the prompt
PREEMPTION_MODES = ("recompute", "swap")  # vLLM's old --preemption-mode values


def check_swap(ec) -> None:
    """EngineConfig's host-memory fields (swap_space, kv_offloading_size): sizes in GiB >= 0, a known mode, swap
    only with host blocks, the host tier only with prefix caching, and none of the features that keep per-block
    state of their own (a draft model's cache, eviction windows, other ranks' caches, another instance's
    transfer)."""
    space, size = ec.swap_space, ec.kv_offloading_size
    _check_gib(space, "swap_space", "--swap-space")
    _check_gib(size, "kv_offloading_size", "--kv-offloading-size")
    if ec.preemption_mode is not None and ec.preemption_mode not in PREEMPTION_MODES:
        raise BrrrError(f"EngineConfig.preemption_mode (--preemption-mode) must be one of "
                        f"{', '.join(PREEMPTION_MODES)} or None, got {ec.preemption_mode!r}")
    if ec.preemption_mode == "swap" and space == 0:
        raise BrrrError("EngineConfig.preemption_mode='swap' needs swap_space > 0 (--swap-space GiB of host memory)")
    own_state = (ec.speculative_config is not None or ec.kv_eviction is not None or ec.disaggregate is not None
                 or ec.tensor_parallel_size > 1)
    if space and ec.preemption_mode != "recompute" and own_state:
        raise BrrrError("EngineConfig.swap_space does not combine with speculative_config, kv_eviction, "
                        "disaggregate or tensor_parallel_size > 1 yet (use preemption_mode='recompute')")
    if size and not ec.enable_prefix_caching:
        raise BrrrError("EngineConfig.kv_offloading_size keeps evicted prefix-cache blocks in host memory: it needs "
                        "enable_prefix_caching=True")
    if size and own_state:
        raise BrrrError("EngineConfig.kv_offloading_size does not combine with speculative_config, kv_eviction, "
                        "disaggregate or tensor_parallel_size > 1 yet")


def _check_gib(value, field: str, flag: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise BrrrError(f"EngineConfig.{field} ({flag}) must be a number of GiB >= 0, got {value!r}")


def check_eviction(ec) -> None:
    """EngineConfig's kv_eviction fields: a known policy, a budget that holds the sinks and two more blocks
    (streaming) or two blocks (snapkv), and what the policy does not combine with."""
    if ec.kv_eviction is None:
        if ec.kv_budget is not None:
            raise BrrrError("EngineConfig.kv_budget is set but kv_eviction is None (use kv_eviction='streaming')")
        return
    if ec.kv_eviction not in KV_EVICTIONS:
        raise BrrrError(f"EngineConfig.kv_eviction must be one of {', '.join(KV_EVICTIONS)} or None, got "
                        f"{ec.kv_eviction!r}")
    if not isinstance(ec.kv_sink_tokens, int) or isinstance(ec.kv_sink_tokens, bool) or ec.kv_sink_tokens < 0:
        raise BrrrError(f"EngineConfig.kv_sink_tokens must be an integer >= 0, got {ec.kv_sink_tokens!r}")
    sink_blocks = -(-ec.kv_sink_tokens // ec.block_size) if ec.kv_eviction == "streaming" else 0
    least = (sink_blocks + 2) * ec.block_size
    if not isinstance(ec.kv_budget, int) or isinstance(ec.kv_budget, bool) or ec.kv_budget < least:
        what = "the sink blocks plus two blocks of window" if ec.kv_eviction == "streaming" else "two blocks"
        raise BrrrError(f"EngineConfig.kv_budget must be an integer >= {least} tokens with kv_eviction="
                        f"{ec.kv_eviction!r} ({what}), got {ec.kv_budget!r}")
    if ec.kv_eviction in COMPACTING_EVICTIONS and ec.enable_prefix_caching:
        raise BrrrError(f"EngineConfig.enable_prefix_caching must be False with kv_eviction={ec.kv_eviction!r} "
                        "(--no-prefix-caching): eviction rewrites a prompt's blocks in place")
    if ec.kv_eviction == "snapkv" and ec.max_num_batched_tokens < SNAPKV_WINDOW:
        raise BrrrError(f"EngineConfig.max_num_batched_tokens ({ec.max_num_batched_tokens}) must be >= "
                        f"{SNAPKV_WINDOW} with kv_eviction='snapkv': the observation window's queries run in one "
                        "step")
    if ec.kv_budget % ec.block_size:
        raise BrrrError(f"EngineConfig.kv_budget ({ec.kv_budget}) must be a multiple of block_size ({ec.block_size}): "
                        "eviction frees whole blocks")
    if ec.speculative_config is not None or ec.disaggregate is not None or ec.tensor_parallel_size > 1:
        raise BrrrError("EngineConfig.kv_eviction does not combine with speculative_config, disaggregate or "
                        "tensor_parallel_size > 1 yet")


@dataclass
class EngineConfig:
    """How the serving engine sizes and schedules itself (see docs/engine.md)."""

    block_size: int = 16
    num_blocks: int | None = None  # KV blocks; else derived from kv_cache_memory, or on CUDA from a profiling run
    kv_cache_memory: int | None = None  # bytes for the KV cache (default on CPU: 256 MiB, capped by what can be used)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes + prefill chunks)
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's context
    cuda_graphs: bool = True  # capture decode steps at batch sizes 1, 2, 4, ... max_num_seqs (CUDA only)
    pack_projections: bool | None = None  # one q/k/v GEMM and one gate/up GEMM; None: when the Triton kernels run
    # every op in its batch-invariant form (docs/batch-invariance.md): a row's logprobs do not depend on the batch
    batch_invariant: bool = False
    enable_lora: bool = False  # serve LoRA adapters (brrr/lora/serving.py); the knobs below size their slots
    max_loras: int = 1  # adapters a step may mix: device slots
    max_lora_rank: int = 16  # the largest adapter rank accepted; slots are padded to it
    max_cpu_loras: int | None = None  # loaded adapters kept on the host (default: max_loras)
    # speculative decoding (docs/speculative.md): a SpeculativeConfig or its dict, vLLM's keys; None: off
    speculative_config: object = None
    tensor_parallel_size: int = 1  # GPUs (CPU processes) the model is sharded over (brrr/distributed/)
    # prefill and decode on separate instances (brrr/distributed/disagg_*.py): "prefill=0,decode=1" or a
    # Disaggregation; None: co-located
    disaggregate: object = None
    # KV-cache element type, vLLM's spelling: auto (the model's dtype), fp8 / fp8_e4m3 (float8_e4m3fn), fp8_e5m2;
    # fp8 stores x / scale per layer's K and V (scale 1.0, as vLLM without calibration; docs/long-context.md)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8: each layer's K and V scale from the first prefill's amax instead of 1.0
    # KV eviction (docs/long-context.md): None keeps every token; "streaming" (StreamingLLM) keeps each sequence's
    # first kv_sink_tokens (rounded up to whole blocks) and its most recent tokens, kv_budget tokens in all;
    # "snapkv" compacts each prompt longer than kv_budget to kv_budget tokens per KV head at the end of its prefill;
    # "h2o" keeps each KV head's kv_budget - 1 rows of most accumulated attention and most recent positions
    kv_eviction: str | None = None
    kv_budget: int | None = None
    kv_sink_tokens: int = 4
    # swap preemption (docs/engine.md), vLLM's names: GiB of pinned host memory for preempted sequences' KV blocks
    # (0: off, every preemption recomputes); preemption_mode None lets the cost rule (brrr/analysis/offload.py)
    # choose per preemption, "recompute" or "swap" forces one
    swap_space: float = 0.0
    preemption_mode: str | None = None
    # the prefix cache's host tier (brrr/engine/host_prefix.py), vLLM's name: GiB of pinned host memory that full
    # cached blocks go to when the device pool evicts them, and come back from on a prefix hit (0: off)
    kv_offloading_size: float = 0.0

    def __post_init__(self):
        if self.speculative_config is not None:
            if isinstance(self.speculative_config, dict):
                self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            elif not isinstance(self.speculative_config, SpeculativeConfig):
                raise BrrrError("EngineConfig.speculative_config must be a dict or a SpeculativeConfig, got "
                                f"{type(self.speculative_config).__name__}")
        if self.disaggregate is not None:
            self.disaggregate = parse_disaggregate(self.disaggregate)
            check_combination(self)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BrrrError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BrrrError(f"EngineConfig.{name} must be an integer >= 1 or None, got {value!r}")
        if self.batch_invariant and (self.tensor_parallel_size > 1 or self.disaggregate is not None):
            raise BrrrError("EngineConfig.batch_invariant runs on one device: tensor_parallel_size must be 1 and "
                            "disaggregate None (a sharded all-reduce's order is not fixed)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BrrrError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                            f"{self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise BrrrError("EngineConfig.calculate_kv_scales needs an fp8 kv_cache_dtype (it is 'auto')")
        if self.kv_cache_dtype != "auto" and self.disaggregate is not None:
            raise BrrrError("EngineConfig.kv_cache_dtype fp8 with disaggregate is not supported: the KV transfer "
                            "carries the model's dtype")
        check_eviction(self)
        check_swap(self)
        if self.batch_invariant and self.kv_cache_dtype != "auto":
            raise BrrrError("EngineConfig.batch_invariant reads the cache in the model's dtype: kv_cache_dtype must "
                            f"be 'auto', got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise BrrrError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise BrrrError(f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                            f"({self.max_loras}): the host cache holds at least the adapters the slots do")
