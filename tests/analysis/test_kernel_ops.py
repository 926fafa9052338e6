"""Op counts behind `brrr bench kernels`, and the roofline plot with measured points."""
import pytest

from brrr.analysis.hardware import get_gpu
from brrr.analysis.kernels import (decode_attention_op, kv_write_op, mla_decode_op, prefill_attention_op, rms_norm_op,
                                   rotary_op, silu_and_mul_op)
from brrr.analysis.roofline import place


def test_memory_bound_ops_count_each_tensor_once():
    assert rms_norm_op(10, 4096).bytes == 2 * (2 * 10 * 4096 + 4096)
    assert rms_norm_op(10, 4096, residual=True).bytes == 2 * (4 * 10 * 4096 + 4096)
    assert rotary_op(10, 32, 8, 128).bytes == 2 * (2 * 10 * 40 * 128 + 2 * 10 * 128)
    assert silu_and_mul_op(10, 14336).bytes == 2 * 3 * 10 * 14336
    assert kv_write_op(10, 8, 128).bytes == 2 * 4 * 10 * 8 * 128 and kv_write_op(10, 8, 128).flops == 0
    h200 = get_gpu("h200")
    for op in (rms_norm_op(4096, 4096), rotary_op(4096, 32, 8, 128), decode_attention_op(64, 4096, 32, 8, 128)):
        assert place(op, h200)["bound"] == "memory"


def test_attention_counts():
    # decode b=64 x 4k, GQA 32/8, hd128: 1.07 GB of K/V, 4 * hd FLOPs per (query head, key)
    op = decode_attention_op(64, 4096, 32, 8, 128)
    assert op.bytes == 2 * (2 * 64 * 4096 * 8 * 128 + 2 * 64 * 32 * 128)
    assert op.flops == 4 * 128 * 32 * 64 * 4096
    fp8 = decode_attention_op(64, 4096, 32, 8, 128, kv_bytes=1)  # an fp8 cache: its rows at one byte, q/out at two
    assert fp8.bytes == 2 * 64 * 4096 * 8 * 128 + 2 * 2 * 64 * 32 * 128 and fp8.flops == op.flops
    assert "fp8" in fp8.name and "fp8" not in op.name
    # causal prefill: S^2/2 pairs (FlashAttention's convention); a cached prefix adds S * prefix pairs
    assert prefill_attention_op(1, 4096, 32, 8, 128).flops == 4 * 128 * 32 * 4096**2 / 2
    assert prefill_attention_op(2, 100, 4, 1, 64, prefix=50).flops == 4 * 64 * 4 * 2 * (100**2 / 2 + 100 * 50)
    assert place(prefill_attention_op(1, 16384, 32, 8, 128), get_gpu("h200"))["bound"] == "compute"


def test_mla_decode_counts():
    # one 576-value latent row per cached token, read once for every head; scores over r + rope, values over r
    op = mla_decode_op(64, 4096, 16, 512, 64)
    assert op.bytes == 2 * (64 * 4096 * 576 + 64 * 16 * (2 * 512 + 64))
    assert op.flops == 2 * 64 * 16 * 4096 * (2 * 512 + 64)
    h200 = get_gpu("h200")
    assert place(op, h200)["bound"] == "memory"  # 16 heads (V2-Lite): ~30 FLOPs a byte
    assert place(mla_decode_op(64, 4096, 128, 512, 64), h200)["bound"] == "compute"  # 128 heads (V3): ~240


def test_plot_with_measured_points(tmp_path):
    pytest.importorskip("matplotlib")
    from brrr.analysis.roofline import plot

    ops = [rms_norm_op(4096, 4096), prefill_attention_op(1, 4096, 32, 8, 128)]
    path = plot(get_gpu("h200"), ops, str(tmp_path / "roof.png"), achieved={ops[0].name: 1e11})
    assert (tmp_path / "roof.png").stat().st_size > 10_000 and path.endswith("roof.png")
