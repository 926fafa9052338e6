"""The fused MoE kernel with int8 / int4 experts against its reference (dequantize, then the per-expert loop), and
against the bf16 fused kernel run on the dequantized weights."""
import pytest
import torch

from brrr.kernels.fused_moe import fused_moe_plan, fused_moe_triton
from brrr.kernels.fused_moe_quant import QuantExperts, fused_moe_quant_ref, fused_moe_quant_triton
from brrr.kernels.moe_routing import route_ref
from brrr.kernels.quant.layouts import int4_params, int4_round, pack_int4_kernel


def quantize_stack(w: torch.Tensor, fmt: str, group: int = 0, symmetric: bool = False,
                   scale_dtype=torch.float32) -> QuantExperts:
    """[E, N, K] float -> QuantExperts (int8 per row, or int4 per group in the kernel layout)."""
    if fmt == "int8":
        scale = (w.abs().amax(dim=2) / 127).clamp(min=1e-12)
        return QuantExperts(torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale, None, 0)
    e, n, k = w.shape
    g = w.view(e, n, k // group, group)
    scale, zero = int4_params(g, symmetric)
    scale = scale.to(scale_dtype).float()  # bf16 models keep bf16 scales
    codes = int4_round(g, scale[..., None], zero[..., None]).view(e, n, k)
    packed = torch.stack([pack_int4_kernel(c, group) for c in codes])
    zeros = None if symmetric else zero.transpose(1, 2).to(torch.uint8).contiguous()
    return QuantExperts(packed, scale.transpose(1, 2).to(scale_dtype).contiguous(), zeros, group)


def _case(top_k, gen, num=6, hidden=128, inter=96, tokens=19):
    w13 = torch.randn(num, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(num, hidden, inter, generator=gen) * 0.1
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, num, generator=gen) + torch.linspace(0, 4, num)  # uneven loads
    logits[:, 2] = -1e9  # an expert no token picks
    weights, ids = route_ref(logits, min(top_k, num - 1), renormalize=True)
    assert not (ids == 2).any()
    return x, weights, ids, w13, w2


def _on(stack, device):
    return QuantExperts(*(None if t is None else t.to(device) for t in stack[:3]), stack.group_size)


CASES = [("int8", 0, False), ("int4", 32, False), ("int4", 32, True)]


@pytest.mark.parametrize("fmt,group,symmetric", CASES)
@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_quantized_fused_moe_bf16_equals_the_dequantized_reference(device, fmt, group, symmetric, top_k):
    gen = torch.Generator().manual_seed(top_k * 7 + group)
    dtype = torch.bfloat16
    x, weights, ids, w13, w2 = _case(top_k, gen)
    gate_up, down = (_on(quantize_stack(w, fmt, group, symmetric, dtype), device) for w in (w13, w2))
    x, weights, ids = x.to(device, dtype), weights.to(device), ids.to(device)
    ref = fused_moe_quant_ref(x, weights, ids, gate_up, down)
    for block_m in (16, 32):
        plan = dict(fused_moe_plan(x.shape[0], ids.shape[1], 6, 128, 96), BLOCK_M=block_m)
        got = fused_moe_quant_triton(x, weights, ids, gate_up, down, plan)
        # bf16: the GEMMs' summation order (and int8's scale after the sum) moves the intermediate roundings
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fmt,group,symmetric", CASES)
def test_quantized_fused_moe_fp32_is_the_float_kernel_on_dequantized_weights(device, fmt, group, symmetric):
    """int4 dequantizes in registers to the reference's values and (BLOCK_K = half a group) sums in the float
    kernel's order: bit for bit the float kernel on the dequantized stacks. int8's per-channel scale multiplies the
    sum instead of each weight: equal to rounding."""
    gen = torch.Generator().manual_seed(3 + group)
    x, weights, ids, w13, w2 = _case(2, gen)
    gate_up, down = (_on(quantize_stack(w, fmt, group, symmetric), device) for w in (w13, w2))
    x, weights, ids = x.to(device), weights.to(device), ids.to(device)
    plan = dict(fused_moe_plan(x.shape[0], 2, 6, 128, 96), BLOCK_K=group // 2 or 64)
    got = fused_moe_quant_triton(x, weights, ids, gate_up, down, plan)
    float_run = fused_moe_triton(x, weights, ids, gate_up.dequantize(), down.dequantize(), plan)
    ref = fused_moe_quant_ref(x, weights, ids, gate_up, down)
    if fmt == "int4":
        assert torch.equal(got, float_run)
    torch.testing.assert_close(got, float_run, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_stack_dequantize_matches_the_per_expert_int4_layout():
    """QuantExperts.dequantize reads the same kernel layout as QuantLinear's int4 (`dequantize_w4`)."""
    from brrr.kernels.quant.layouts import dequantize_w4

    w = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))
    s = quantize_stack(w, "int4", 32)
    for e in range(3):
        assert torch.equal(s.dequantize()[e], dequantize_w4(s.qweight[e], s.scales[e], s.zeros[e], 32))
    assert (s.dequantize() - w).abs().max() < 0.1 * w.abs().max()
