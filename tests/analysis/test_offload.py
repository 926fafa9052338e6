"""The swap-or-recompute rule (brrr/analysis/offload.py), worked by hand for Llama-3.1-8B on an H100 SXM."""
import dataclasses

import pytest

from brrr.analysis.hardware import get_gpu
from brrr.analysis.offload import COPY_LAUNCH_S, prefers_swap, recompute_seconds, swap_seconds, swap_threshold
from brrr.errors import BrrrError
from brrr.presets import preset_config


def test_swap_wins_above_the_crossover_and_recompute_below():
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16 K and V: 32 x 2 x 8 x 128 x 2 = 131,072 bytes a token.
    # H100 SXM: PCIe 128 GB/s both ways, 64e9 one way; bf16 peak 989.4e12 FLOP/s.
    #   swap(t) = 2 x (131,072 t / 64e9 + 64 tensors x 5 us) = 4.096e-6 t + 6.4e-4 s
    # Prefill: 2 x 7,504,658,432 matmul params a token plus 2 x 32 layers x 32 heads x (128 + 128) = 524,288 FLOPs
    # a (query, key) pair, t (t + 1) / 2 pairs:
    #   recompute(t) = (15,009,316,864 t + 262,144 t (t + 1)) / 989.4e12
    # t = 57: swap 8.73472e-4 s, recompute (855,531,061,248 + 866,648,064) / 989.4e12 = 8.6557e-4 s -> recompute
    # t = 58: swap 8.77568e-4 s, recompute (870,540,378,112 + 897,056,768) / 989.4e12 = 8.8077e-4 s -> swap
    cfg, gpu = preset_config("llama-3.1-8b"), get_gpu("h100-sxm")
    assert COPY_LAUNCH_S == 5e-6 and gpu.pcie == 128e9 and gpu.peak("bf16") == 989.4e12
    assert swap_seconds(cfg, 57, gpu) == pytest.approx(4.096e-6 * 57 + 6.4e-4)
    assert recompute_seconds(cfg, 57, gpu) == pytest.approx((15_009_316_864 * 57 + 262_144 * 57 * 58) / 989.4e12)
    assert swap_seconds(cfg, 58, gpu) == pytest.approx(8.77568e-4)
    assert recompute_seconds(cfg, 58, gpu) == pytest.approx(871_437_434_880 / 989.4e12)
    assert not prefers_swap(cfg, 57, gpu) and prefers_swap(cfg, 58, gpu)
    assert swap_threshold(cfg, gpu, 131072) == 58
    assert all(prefers_swap(cfg, t, gpu) for t in (58, 100, 1000, 8192, 131072))
    assert not any(prefers_swap(cfg, t, gpu) for t in (1, 16, 57))


def test_fp8_kv_halves_the_bytes_and_lowers_the_crossover():
    # fp8 K/V: 65,536 bytes a token, swap(t) = 2.048e-6 t + 6.4e-4; the recompute is the same, so the crossover falls
    cfg, gpu = preset_config("llama-3.1-8b"), get_gpu("h100-sxm")
    assert swap_seconds(cfg, 100, gpu, "fp8") == pytest.approx(2.048e-6 * 100 + 6.4e-4)
    low = swap_threshold(cfg, gpu, 131072, kv_dtype="fp8")
    assert low < swap_threshold(cfg, gpu, 131072)
    assert prefers_swap(cfg, low, gpu, "fp8") and not prefers_swap(cfg, low - 1, gpu, "fp8")


def test_no_crossover_within_the_context_and_no_pcie_figure():
    cfg, gpu = preset_config("llama-3.1-8b"), get_gpu("h100-sxm")
    assert swap_threshold(cfg, gpu, 57) is None  # recompute is cheaper at every length up to 57
    with pytest.raises(BrrrError, match="PCIe"):
        swap_seconds(cfg, 100, dataclasses.replace(gpu, pcie=0.0))
    with pytest.raises(BrrrError, match="max_tokens"):
        swap_threshold(cfg, gpu, 0)
