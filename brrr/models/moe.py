"""Mixture-of-experts MLP blocks in the reference form: Mixtral, Qwen2-MoE (a shared expert behind a sigmoid gate),
Qwen3-MoE and DeepSeek-V2/V3 (always-on shared experts, grouped routers, a scaling factor).

Each block is a router `gate` (a bias-free Linear hidden -> experts; DeepSeek-V3's also holds
e_score_correction_bias), `experts`, one small gated MLP per expert under the checkpoint's names (Mixtral's
w1/w3/w2, everyone else's gate_proj/up_proj/down_proj), and the shared parts. The routing is `kernels.moe_routing`,
the expert computation `kernels.moe_experts`. Layers listed in ModelConfig.dense_mlp_layers keep the dense MLP.
In memory the block is the layer's `mlp` (transformers v5's name); Mixtral's checkpoints call it block_sparse_moe,
renamed at the checkpoint boundary (brrr/state_dict.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brrr.config import ModelConfig
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.fused_moe_quant import QuantExperts, fused_moe_quant
from brrr.kernels.moe_experts import moe_experts, moe_experts_ref
from brrr.kernels.moe_routing import route

BALANCING_BIAS = "e_score_correction_bias"  # DeepSeek-V3's router buffer, under its checkpoint name


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x) of a given width; Mixtral's experts name the three w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, hidden: int, inter: int, mixtral: bool = False):
        super().__init__()
        self.names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for name, (i, o) in zip(self.names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            setattr(self, name, nn.Linear(i, o, bias=False))

    def projections(self):
        """(gate, up, down) modules."""
        return tuple(getattr(self, n) for n in self.names)

    def forward(self, x):
        gate, up, down = self.projections()
        return down(silu_and_mul(gate(x), up(x)))


class Router(nn.Module):
    """The router's Linear (weight [E, H]) and, for DeepSeek-V3, the balancing bias added only to the choice."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.deepseek = cfg.architecture.startswith("Deepseek")
        # a buffer (as in transformers): no gradient reaches it, it only picks experts; training moves it after
        # each optimizer step (brrr/train/moe_loss.py's bias balancing); checkpoints hold it
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.num_experts) if cfg.router_scoring == "sigmoid_grouped" else None)

    def forward(self, x):
        """-> router logits [T, E]; DeepSeek's routers compute them in fp32, the others in x's dtype."""
        if self.deepseek:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_tok
        mixtral = cfg.architecture == "MixtralForCausalLM"
        inter = cfg.intermediate_size if mixtral else cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(GatedMLP(cfg.hidden_size, inter, mixtral) for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: one shared expert scaled by sigmoid(gate x)
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        if cfg.num_shared_experts:  # DeepSeek: n_shared_experts always-on experts, one MLP of their summed width
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
        self.last_routing: torch.Tensor | None = None  # training: the step's router logits, for the aux losses

    def route(self, x):
        """-> (weights [T, k], expert ids [T, k]) of each token."""
        cfg = self.cfg
        logits = self.gate(x)
        weights, ids = route(logits, self.top_k, cfg.router_scoring, cfg.norm_topk_prob, cfg.n_group,
                             cfg.topk_group, self.gate.e_score_correction_bias, cfg.routed_scaling_factor)
        if cfg.architecture.startswith("Qwen"):  # Qwen rounds the weights to the activations' dtype first
            weights = weights.to(x.dtype)
        if self.training:
            self.last_routing = logits
        return weights, ids

    def add_shared(self, x, out):
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def forward(self, x):
        weights, ids = self.route(x)
        return self.add_shared(x, moe_experts_ref(x, weights, ids, [e.projections() for e in self.experts]))

    def stackable(self) -> bool:
        """Whether the experts are plain Linears (quantized ones stack into `QuantStackedMoeBlock` instead)."""
        return all(type(p) is nn.Linear for e in self.experts for p in e.projections())

    def stacked(self) -> "StackedMoeBlock":
        return StackedMoeBlock(self)


class StackedMoeBlock(SparseMoeBlock):
    """The serving form (prepare_for_serving swaps it in): the experts' weights stacked, w_gate_up [E, 2I, H] (each
    expert's gate rows then up rows, transformers v5's layout) and w_down [E, H, I], for the grouped GEMMs (and the
    fused MoE kernel); router and shared experts are the reference block's own modules."""

    def __init__(self, block: SparseMoeBlock):
        nn.Module.__init__(self)
        self.cfg, self.top_k, self.last_routing = block.cfg, block.top_k, None
        self.gate, self.shared_expert, self.shared_expert_gate = block.gate, block.shared_expert, block.shared_expert_gate
        self.shared_experts = block.shared_experts
        projs = [e.projections() for e in block.experts]
        self.w_gate_up = nn.Parameter(torch.stack([torch.cat((g.weight, u.weight)) for g, u, _ in projs]),
                                      requires_grad=False)
        self.w_down = nn.Parameter(torch.stack([d.weight for _, _, d in projs]), requires_grad=False)

    def forward(self, x):
        weights, ids = self.route(x)
        return self.add_shared(x, moe_experts(x, weights, ids, self.w_gate_up, self.w_down))

class QuantStackedMoeBlock(SparseMoeBlock):
    """The serving form of a block whose experts are weight-only int8 or int4 (`brrr quantize`): the stacks the
    fused quantized-MoE kernel reads, gate_up [E, 2I, H] and down [E, H, I] as `QuantExperts` (brrr/quant/experts.py
    builds them from the per-expert QuantLinears); router and shared experts are the reference block's modules."""

    def __init__(self, block: SparseMoeBlock, gate_up: QuantExperts, down: QuantExperts):
        nn.Module.__init__(self)
        self.cfg, self.top_k, self.last_routing = block.cfg, block.top_k, None
        self.gate, self.shared_expert, self.shared_expert_gate = block.gate, block.shared_expert, block.shared_expert_gate
        self.shared_experts = block.shared_experts
        self.group_sizes = (gate_up.group_size, down.group_size)
        for prefix, stack in (("gate_up", gate_up), ("down", down)):  # buffers: they move with the model
            for name in ("qweight", "scales", "zeros"):
                self.register_buffer(f"{prefix}_{name}", getattr(stack, name))

    def stacks(self) -> tuple[QuantExperts, QuantExperts]:
        return tuple(QuantExperts(getattr(self, f"{p}_qweight"), getattr(self, f"{p}_scales"),
                                  getattr(self, f"{p}_zeros"), g) for p, g in zip(("gate_up", "down"), self.group_sizes))

    def forward(self, x):
        weights, ids = self.route(x)
        return self.add_shared(x, fused_moe_quant(x, weights, ids, *self.stacks()))


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    return cfg.num_experts > 0 and layer not in cfg.dense_mlp_layers

