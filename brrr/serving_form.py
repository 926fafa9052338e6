"""The serving form of the reference model: `prepare_for_serving` swaps modules at load time.

The reference (models/llama.py) keeps Hugging Face's modules and GEMM shapes, so it matches transformers token for
token and saves by name. Serving runs the same function with fewer, fused launches, installed the way gpt-fast's
quantize handlers swap nn.Linear for their own modules:
- `PackedAttention`: q/k/v as one projection. At small batch a GEMM is a read of its weights, and one read of the
  three costs less than three (launches, tails). After a quantized (Triton) GEMV the decode kernel also applies
  RoPE and writes the cache, since that GEMV lets attention start early.
- `PackedMLP` (nn.Linear) and `GatedGemvMLP` (QuantLinear): gate/up as one projection; the quantized one runs
  SiLU-and-mul in its GEMV's epilogue at batch 1.
- `QuantLogitsHead`: a quantized lm_head's GEMV stores the fp32 logits itself, no cast kernel after it.
- `GemvNormLlamaForCausalLM`: where every projection's GEMV takes the norms (int4 g128), batch-1 decode runs each
  RMSNorm and residual add inside the GEMVs, the final norm inside lm_head's where it can.
- `LoraLinear` (with LoRA slots, brrr/lora/serving_slots.py): every projection, packed or not, plus each row's
  adapter update. A packed projection keeps one GEMM and gets one shrink and one expand for its slices, each slice
  with its own A and B. LoRA keeps the projections' plain outputs: no SiLU-and-mul or norms inside a quantized
  GEMV's epilogue and no early release, since the update must land on the GEMV's output before anything reads it.
bf16 sums of a packed GEMM can round differently from the separate ones (docs/models.md), so the tests compare the
two forms with a tolerance. Checkpoints are written from the reference form (`brrr.loader.hf_state_dict` splits
packed projections back into Hugging Face's names).
"""
from __future__ import annotations

import torch
from torch import nn

from brrr.config import EngineConfig
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta, attention, silu_and_mul
from brrr.kernels.batch_invariant import batch_invariant
from brrr.kernels.dispatch import fast_path
from brrr.kernels.rms_norm import embed_rms_norm
from brrr.lora.serving_slots import LoraLinear, LoraSlots
from brrr.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from brrr.models.moe import QuantStackedMoeBlock, SparseMoeBlock
from brrr.prune.semi_structured import swap_semi_structured
from brrr.quant.experts import expert_stacks
from brrr.quant.linear import QuantLinear


class PackedAttention(nn.Module):
    """LlamaAttention with q/k/v as one projection (outputs: q, then k, then v). decode_rope: a step of decodes
    rotates q/k and writes the new K/V inside the decode kernel (after a Triton GEMV, which releases attention early),
    else the rotary kernel does."""

    def __init__(self, attn: LlamaAttention, qkv_proj: nn.Module, decode_rope: bool):
        super().__init__()
        self.layer, self.n_heads, self.n_kv, self.head_dim = attn.layer, attn.n_heads, attn.n_kv, attn.head_dim
        self.scale, self.sliding_window, self.decode_rope = attn.scale, attn.sliding_window, decode_rope
        self.qkv_proj, self.o_proj, self.q_norm, self.k_norm = qkv_proj, attn.o_proj, attn.q_norm, attn.k_norm

    def forward(self, x, cos, sin, meta: AttnMeta, residual=None, next_norm=None):
        """As LlamaAttention's. residual, next_norm (the next RMSNorm's (weight, eps); `GemvNormLlamaForCausalLM`):
        o_proj adds the residual and returns (h, the next norm's PendingNorm); x may then be a PendingNorm."""
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim] + [self.n_kv * self.head_dim] * 2, -1)
        q = q.view(-1, self.n_heads, self.head_dim)
        k = k.view(-1, self.n_kv, self.head_dim)
        v = v.view(-1, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attention(q, k, v, meta, self.layer, self.scale, self.sliding_window, rope=(cos, sin),
                        decode_rope=self.decode_rope)
        return self.o_proj(out) if residual is None else self.o_proj(out, residual=residual, next_norm=next_norm)


class PackedMLP(nn.Module):
    """LlamaMLP with gate/up as one projection (outputs: gate, then up)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def activation(self, x):
        """silu(gate) * up; the kernel reads the two halves of the packed output in place."""
        return silu_and_mul(*self.gate_up_proj(x).chunk(2, -1))

    def forward(self, x, residual=None, next_norm=None):
        """residual, next_norm: as `PackedAttention.forward`'s, for down_proj."""
        act = self.activation(x)
        return self.down_proj(act) if residual is None else self.down_proj(act, residual=residual, next_norm=next_norm)


class GatedGemvMLP(PackedMLP):
    """PackedMLP of QuantLinears: weight-only int4/int8 run SiLU-and-mul in the gate/up GEMV's epilogue at batch-1
    decode (`QuantLinear.gated`), one kernel where the packed GEMM and silu_and_mul were two."""

    def activation(self, x):
        return self.gate_up_proj.gated(x)


class QuantLogitsHead(nn.Module):
    """A quantized lm_head whose GEMV stores the logits as fp32 (weight-only int4/int8/FP8: the values `.float()`
    of its 16-bit output gives), from a tensor or from the final norm's PendingNorm."""

    def __init__(self, linear: QuantLinear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x, out_dtype=torch.float32)


class GemvNormLlamaForCausalLM(LlamaForCausalLM):
    """The serving model when every projection's GEMV takes the norms (`QuantLinear.takes_norms`). A one-row step
    (batch-1 decode) runs each RMSNorm inside the GEMV that reads its output and each residual add inside the GEMV
    before it: o_proj and down_proj write h = y + residual and the next norm's PendingNorm, so a layer is its four
    GEMVs and attention, no norm kernels. With final_norm_in_head, `logits` hands the final norm to lm_head's GEMV
    the same way. Steps of more rows run the reference layers (with the packed modules). Adopts the modules of the
    model it wraps; nothing is copied."""

    def __init__(self, model: LlamaForCausalLM, final_norm_in_head: bool):
        nn.Module.__init__(self)
        self.config, self.model, self.lm_head = model.config, model.model, model.lm_head
        self.final_norm_in_head = final_norm_in_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        if input_ids.numel() != 1:
            return self.model(input_ids, positions, meta)
        h, _ = self.decode_one_row(input_ids, positions, meta)
        return self.model.norm(h)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        if input_ids.numel() != 1 or not self.final_norm_in_head:
            return self.compute_logits(self(input_ids, positions, meta))
        _, final = self.decode_one_row(input_ids, positions, meta)
        return self.compute_logits(final)

    def decode_one_row(self, input_ids, positions, meta):
        """(h, the final norm's PendingNorm) after the last layer, for one token."""
        m = self.model
        first = m.layers[0].input_layernorm
        x, h = embed_rms_norm(input_ids, m.embed_tokens.weight, first.weight, first.eps)  # x: the first layer's input
        cos, sin = m.rotary_emb(positions, h.dtype)
        nexts = [layer.input_layernorm for layer in m.layers[1:]] + [m.norm]
        for layer, norm in zip(m.layers, nexts):
            post = layer.post_attention_layernorm
            h, x = layer.self_attn(x, cos, sin, meta, residual=h, next_norm=(post.weight, post.eps))
            h, x = layer.mlp(x, residual=h, next_norm=(norm.weight, norm.eps))
        return h, x


class BatchInvariantLlamaForCausalLM(LlamaForCausalLM):
    """The serving model of an engine built with batch_invariant: the reference form's modules (nothing packed or
    fused, so the engine runs exactly the modules a trainer runs), each call inside `batch_invariant()`, captured
    CUDA graphs included. Adopts the modules of the model it wraps; nothing is copied, so weights a trainer updates
    in place are the engine's."""

    def __init__(self, model: LlamaForCausalLM):
        nn.Module.__init__(self)
        self.config, self.model, self.lm_head = model.config, model.model, model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        with batch_invariant():
            return super().forward(input_ids, positions, meta)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        with batch_invariant():
            return super().logits(input_ids, positions, meta)

    def compute_logits(self, hidden) -> torch.Tensor:
        with batch_invariant():
            return super().compute_logits(hidden)


def _batch_invariant_form(model: LlamaForCausalLM, lora: LoraSlots | None) -> LlamaForCausalLM:
    if isinstance(model, BatchInvariantLlamaForCausalLM):
        return model
    if isinstance(model, GemvNormLlamaForCausalLM) or any(isinstance(m, (QuantLinear, PackedAttention, PackedMLP))
                                                          for m in model.modules()):
        raise BrrrError("batch_invariant: this model has quantized or packed projections, which have no "
                        "batch-invariant form; load it unquantized (and not prepared for serving before)")
    if lora is not None:
        _add_lora(model, lora)
    return BatchInvariantLlamaForCausalLM(model)


def _packed_linear(linears: list[nn.Linear]) -> nn.Linear:
    w = linears[0].weight
    out = nn.Linear(w.shape[1], sum(m.out_features for m in linears), bias=linears[0].bias is not None,
                    device=w.device, dtype=w.dtype)
    out.weight.copy_(torch.cat([m.weight for m in linears]))
    if out.bias is not None:
        out.bias.copy_(torch.cat([m.bias for m in linears]))
    return out.requires_grad_(False)


def _packed(linears: list[nn.Module]) -> nn.Module | None:
    """One module computing the given projections side by side, or None where they cannot be joined (mixed kinds,
    nf4, act-order GPTQ)."""
    if all(type(m) is nn.Linear for m in linears):
        return _packed_linear(linears)
    if all(isinstance(m, QuantLinear) for m in linears):
        return QuantLinear.concat(linears)
    return None


def _serving_attention(attn: LlamaAttention, lora: LoraSlots | None) -> nn.Module:
    qkv = _packed([attn.q_proj, attn.k_proj, attn.v_proj])
    if qkv is None:
        return attn
    quantized = isinstance(qkv, QuantLinear)
    if quantized and lora is None:
        qkv.release_early = True  # decode attention may launch at the GEMV's last K step
    return PackedAttention(attn, qkv, decode_rope=quantized)


def _serving_mlp(mlp: LlamaMLP, lora: LoraSlots | None) -> nn.Module:
    gate_up = _packed([mlp.gate_proj, mlp.up_proj])
    if gate_up is None:
        return mlp
    gated = isinstance(gate_up, QuantLinear) and lora is None
    return (GatedGemvMLP if gated else PackedMLP)(gate_up, mlp.down_proj)


def _with_lora(module: nn.Module, prefix: str, names: tuple[str, ...], slots: LoraSlots,
               outs: dict[str, int]) -> nn.Module:
    """`module` (computing the projections `names` side by side) with the adapters' updates added."""
    if isinstance(module, LoraLinear):  # prepared for another engine's slots before: these slots now
        module = module.base
    if isinstance(module, QuantLinear):
        module.release_early = False  # the update is added after the GEMV: nothing may read its output earlier
    target = slots.target(prefix + "+".join(names), tuple(prefix + n for n in names), module.in_features,
                          tuple(outs[n] for n in names))
    return LoraLinear(module, slots, target)


def _add_lora(model: LlamaForCausalLM, slots: LoraSlots) -> None:
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": cfg.hidden_size, "gate_proj": cfg.intermediate_size,
             "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn_prefix, mlp_prefix = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if isinstance(attn, PackedAttention):
            attn.qkv_proj = _with_lora(attn.qkv_proj, attn_prefix, ("q_proj", "k_proj", "v_proj"), slots, sizes)
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, _with_lora(getattr(attn, name), attn_prefix, (name,), slots, sizes))
        attn.o_proj = _with_lora(attn.o_proj, attn_prefix, ("o_proj",), slots, sizes)
        if isinstance(mlp, GatedGemvMLP):  # prepared without LoRA before: SiLU-and-mul must follow the update
            mlp = layer.mlp = PackedMLP(mlp.gate_up_proj, mlp.down_proj)
        if isinstance(mlp, PackedMLP):
            mlp.gate_up_proj = _with_lora(mlp.gate_up_proj, mlp_prefix, ("gate_proj", "up_proj"), slots, sizes)
        else:
            for name in ("gate_proj", "up_proj"):
                setattr(mlp, name, _with_lora(getattr(mlp, name), mlp_prefix, (name,), slots, sizes))
        mlp.down_proj = _with_lora(mlp.down_proj, mlp_prefix, ("down_proj",), slots, sizes)


def _takes_norms(m: nn.Module) -> bool:
    return isinstance(m, QuantLinear) and m.takes_norms


def _gemvs_take_norms(model: LlamaForCausalLM) -> bool:
    """Every projection is a GEMV that takes a PendingNorm and the residual. fp16 keeps the norm kernels: weight * h
    before the 1 / rms could overflow where h / rms would not."""
    if model.model.embed_tokens.weight.dtype == torch.float16:
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (isinstance(attn, PackedAttention) and isinstance(mlp, GatedGemvMLP)):
            return False
        if not all(map(_takes_norms, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
            return False
    return True


@torch.no_grad()
def prepare_for_serving(model: LlamaForCausalLM, engine_config: EngineConfig,
                        lora: LoraSlots | None = None) -> LlamaForCausalLM:
    """The model the engine runs: `model` with its serving modules swapped in (in place), or wrapped in
    `GemvNormLlamaForCausalLM` where its GEMVs take the norms. `engine_config.pack_projections` (None: when the
    Triton kernels run on the model's device) says whether to; False keeps the reference form. Layer by layer,
    each packed copy replaces the originals, so peak memory grows by one layer. lora: every projection also adds
    each row's adapter update from these slots. `engine_config.batch_invariant`: the reference form, wrapped to run
    in the batch-invariant mode (`BatchInvariantLlamaForCausalLM`). Idempotent."""
    cfg = model.config
    if lora is not None and (cfg.num_experts or cfg.kv_lora_rank):
        raise BrrrError(f"serving LoRA adapters covers the dense Llama family; {cfg.architecture} is not one")
    if engine_config.batch_invariant:
        return _batch_invariant_form(model, lora)
    pack = engine_config.pack_projections
    if pack is None:
        pack = fast_path(next(model.parameters()).device)
    if isinstance(model, GemvNormLlamaForCausalLM):
        if lora is not None:
            raise BrrrError("this model was prepared for serving without LoRA (norms inside its GEMVs); load it "
                            "again to serve adapters")
        return model
    if not pack:
        if lora is not None:
            _add_lora(model, lora)
        return model
    for layer in model.model.layers:
        if isinstance(layer.self_attn, LlamaAttention):
            layer.self_attn = _serving_attention(layer.self_attn, lora)
        if isinstance(layer.mlp, LlamaMLP):
            layer.mlp = _serving_mlp(layer.mlp, lora)
        elif type(layer.mlp) is SparseMoeBlock and layer.mlp.stackable():  # stacked for the grouped GEMMs
            layer.mlp = layer.mlp.stacked()
        elif type(layer.mlp) is SparseMoeBlock and (stacks := expert_stacks(layer.mlp.experts)) is not None:
            layer.mlp = QuantStackedMoeBlock(layer.mlp, *stacks)  # int8 / int4 experts: the fused quantized kernel
    if lora is None:  # LoRA slots wrap the dense projections
        swap_semi_structured(model)  # 2:4-pruned projections (and their packed forms) onto the sparse GEMM
    else:
        _add_lora(model, lora)
    if isinstance(model.lm_head, QuantLinear):
        model.lm_head = QuantLogitsHead(model.lm_head)
    if _gemvs_take_norms(model):
        head = model.lm_head
        return GemvNormLlamaForCausalLM(model, isinstance(head, QuantLogitsHead) and head.linear.takes_norms)
    return model
