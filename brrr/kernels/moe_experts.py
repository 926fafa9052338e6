"""The routed experts of an MoE layer: out[t] = sum over t's k choices (e, w) of w * down_e(silu(gate_e x) * up_e x).

Two plain-torch forms of one computation:
- `moe_experts_ref`: a loop over the experts that got tokens (transformers' loop): gather the expert's tokens, its
  three GEMMs, scale by the routing weight, index_add into the output. Per-expert weights as separate tensors (the
  reference model's nn.Linear modules, checkpoint names), so quantized expert modules swap in one by one.
- `moe_experts_grouped_mm`: dropless dispatch through grouped GEMM (MegaBlocks' point): sort the (token, choice)
  pairs by expert, one `torch._grouped_mm` over the expert runs for gate/up and one for down, then a weighted sum
  back per token. The weights stacked [E, out, in] (what a serving form holds). No capacity, nothing dropped; an
  expert with no tokens is an empty run.
Both sum a token's expert outputs in expert order, in the activations' dtype, as transformers does. `moe_experts`
dispatches the stacked form: the fused Triton kernel (brrr/kernels/fused_moe.py) on CUDA, else grouped GEMMs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brrr.errors import BrrrError
from brrr.kernels.activation import silu_and_mul
from brrr.kernels.dispatch import use_triton
from brrr.kernels.fused_moe import expert_counts, fused_moe_ok, fused_moe_triton, sum_in_expert_order


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
    """x [T, H]; weights [T, k] (fp32), ids [T, k] from `route`; experts: a sequence of (gate, up, down) callables
    or weight tensors per expert ([I, H], [I, H], [H, I]). -> [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise BrrrError("the per-expert MoE loop reads the experts' loads back to the host, which a CUDA graph "
                        "cannot hold: serve MoE models in the serving form (pack_projections, the default on CUDA: "
                        "the fused kernel) or with cuda_graphs=False")
    hit = torch.bincount(ids.flatten(), minlength=len(experts)).nonzero().flatten().tolist()  # one host read
    for e in hit:
        token, choice = torch.where(ids == e)
        gate, up, down = (_apply(f) for f in experts[e])
        h = x[token]
        y = down(silu_and_mul(gate(h), up(h)))
        # the product in fp32 (the weights' dtype), rounded once to x's: as transformers' Mixtral and DeepSeek do
        out.index_add_(0, token, (y * weights[token, choice, None]).to(x.dtype))
    return out


def _apply(f):
    return f if callable(f) else (lambda h, w=f: F.linear(h, w))


def grouped_mm_ok(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """torch._grouped_mm exists and takes these: bf16 on CUDA (Hopper's kernel), bf16/fp32 on CPU, rows 16-byte
    aligned."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w_gate_up.dtype:
        return False
    dtypes = (torch.bfloat16,) if x.is_cuda else (torch.bfloat16, torch.float32)
    aligned = all(d * x.element_size() % 16 == 0 for d in (w_down.shape[1], w_down.shape[2]))
    return x.dtype in dtypes and aligned


def moe_experts(x, weights, ids, w_gate_up, w_down):
    """The routed experts with stacked weights (the serving form): the fused Triton kernel on CUDA, else grouped
    GEMMs where torch._grouped_mm takes them, else the per-expert loop over views of the stacks."""
    if use_triton(x, w_gate_up, w_down) and fused_moe_ok(x, w_gate_up, w_down):
        return fused_moe_triton(x, weights, ids, w_gate_up, w_down)
    if grouped_mm_ok(x, w_gate_up, w_down):
        return moe_experts_grouped_mm(x, weights, ids, w_gate_up, w_down)
    inter = w_gate_up.shape[1] // 2
    return moe_experts_ref(x, weights, ids, [(w[:inter], w[inter:], d) for w, d in zip(w_gate_up, w_down)])


def moe_experts_grouped_mm(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; weights/ids [T, k]; w_gate_up [E, 2I, H] (gate rows then up rows, as transformers v5 stacks
    them), w_down [E, H, I] -> [T, H]."""
    num_experts, k = w_gate_up.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens ascending
    token = order // k
    ends = expert_counts(flat, num_experts).cumsum(0).to(torch.int32)  # each expert's run ends here
    h = torch.ops.aten._grouped_mm(x[token], w_gate_up.transpose(1, 2), offs=ends)
    inter = w_gate_up.shape[1] // 2
    h = silu_and_mul(h[:, :inter], h[:, inter:])
    y = torch.ops.aten._grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    return sum_in_expert_order(torch.empty_like(y).index_copy_(0, order, y), ids, x)
