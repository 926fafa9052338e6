"""The attention kernels' selection plan (brrr/kernels/attention/plan.py), on the CPU: which decode kernel a step
takes at the boundaries of each rule, the launch parameters of the split kernel, and the graphs a capture needs.
Off a GPU the plan assumes 132 SMs (an H100's)."""
import dataclasses

import pytest
import torch

from brrr.kernels.attention import DecodePlan, decode_graph_plans, decode_plan, graph_plan_for
from brrr.kernels.attention.plan import LEAN_CONTEXT, LEAN_MMA_ABOVE, LEAN_MMA_GRAPH, SHORT_CONTEXT, split_plan

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def kernel(batch, context, heads=32, kv_heads=8, dim=128, dtype=BF16, block_size=16, rope=True):
    return decode_plan(batch, context, heads, kv_heads, dim, dtype, block_size, CPU, rope).kernel


def test_a_plan_is_frozen_and_hashable():
    a = decode_plan(1, 200, 32, 8, 128, BF16, 16, CPU)
    b = DecodePlan(**dataclasses.asdict(a))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != decode_plan(1, 201, 32, 8, 128, BF16, 16, CPU)  # the bound is part of the launch
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_warps = 4


def test_lean_kernels_take_short_contexts_of_batches_within_a_wave():
    assert kernel(1, 1) == kernel(1, LEAN_MMA_ABOVE) == "lean"
    assert kernel(1, LEAN_MMA_ABOVE + 1) == kernel(1, LEAN_CONTEXT) == "lean_mma"
    assert kernel(1, LEAN_CONTEXT + 1) == "split"
    assert kernel(4, 200) == "lean_mma" and kernel(5, 200) == "split"  # 4 x 32 query heads fit 132 SMs, 5 x 32 not
    assert kernel(1, 200, rope=False) == "split"  # the lean kernels rotate and write the cache themselves


@pytest.mark.parametrize("change", [dict(dtype=torch.float32), dict(dim=64), dict(heads=32, kv_heads=2),
                                    dict(block_size=8)])
def test_tensor_cores_need_16_bit_heads_of_128_and_small_groups(change):
    assert kernel(1, 200, **change) == "lean"


def test_head_dim_256_never_takes_a_lean_kernel():
    assert kernel(1, 100, heads=8, kv_heads=8, dim=256) == "split"


def test_split_plans():
    """RoPE path: one-tile parts of 64 keys; full batches short of SHORT_CONTEXT take 3-stage tiles, longer ones 2;
    at most two tiles a program, one stage; batch 1 at 4096 keys 64 parts in 8 warps."""
    p = decode_plan(1, 4096, 32, 8, 128, BF16, 16, CPU)
    assert (p.kernel, p.splits, p.wave, p.block_n, p.min_part, p.whole, p.num_warps, p.num_stages) == \
        ("split", 64, 16, 64, 64, 1, 8, 3)
    p = decode_plan(1, 2048, 32, 8, 128, BF16, 16, CPU)
    assert (p.splits, p.num_stages) == (16, 1)  # <= two 64-key tiles a part
    full = [decode_plan(64, c, 32, 8, 128, BF16, 16, CPU, rope) for c in (SHORT_CONTEXT, SHORT_CONTEXT + 1)
            for rope in (False, True)]
    assert [(p.splits, p.block_n, p.num_stages, p.num_warps) for p in full] == \
        [(1, 128, 3, 4), (1, 64, 3, 4), (1, 64, 2, 4), (1, 64, 2, 4)]
    assert [p.early_loads for p in full] == [True] * 4
    plain = decode_plan(1, 4096, 32, 8, 128, BF16, 16, CPU, rope=False)
    assert (plain.min_part, plain.whole, plain.block_n, plain.num_warps) == (128, 2, 128, 4)
    hd256 = decode_plan(1, 4096, 8, 8, 256, BF16, 16, CPU)
    assert (hd256.block_n, hd256.early_loads, hd256.whole) == (32, False, 2)


def test_an_fp8_cache_takes_its_own_split_tile():
    """64 keys x 6 stages on 2 warps at any split and context (the bf16 rule's tiles vary with both); the splits
    stay the bf16 rule's, and head dim 256 keeps its shared-memory-bound tile."""
    for batch, context in ((64, 4096), (64, 16384), (1, 32768), (16, 8192)):
        fp8 = split_plan(batch, 8, 128, context, CPU, False, kv_fp8=True)
        bf16 = split_plan(batch, 8, 128, context, CPU, False)
        assert (fp8.block_n, fp8.num_stages, fp8.num_warps) == (64, 6, 2)
        assert (fp8.splits, fp8.wave) == (bf16.splits, bf16.wave)
    hd256 = split_plan(64, 8, 256, 4096, CPU, False, kv_fp8=True)
    assert (hd256.block_n, hd256.num_warps) == (32, 4)


def test_graph_plans_for_a_capture():
    """One graph for any context, then tighter ones: SHORT_CONTEXT, the lean bound and, when longer lean bounds
    take tensor cores, LEAN_MMA_GRAPH; a batch beyond a wave of query heads gets the split ones only."""
    def bounds(batch, bound, **kw):
        args = dict(heads=32, kv_heads=8, dim=128, dtype=BF16, block_size=16) | kw
        plans = decode_graph_plans(batch, bound, args["heads"], args["kv_heads"], args["dim"], args["dtype"],
                                   args["block_size"], CPU)
        return [(p.max_context, p.kernel) for p in plans]

    assert bounds(1, 4096) == [(4096, "split"), (SHORT_CONTEXT, "split"), (LEAN_CONTEXT, "lean_mma"),
                               (LEAN_MMA_GRAPH, "lean")]
    assert bounds(8, 4096) == [(4096, "split"), (SHORT_CONTEXT, "split")]
    assert bounds(1, 4096, dtype=torch.float32) == [(4096, "split"), (SHORT_CONTEXT, "split"), (LEAN_CONTEXT, "lean")]
    assert bounds(1, 200) == [(200, "lean_mma"), (LEAN_MMA_GRAPH, "lean")]
    assert bounds(1, 100) == [(100, "lean")]


def test_a_step_replays_the_tightest_bound_its_longest_context_fits():
    plans = decode_graph_plans(1, 4096, 32, 8, 128, BF16, 16, CPU)
    picked = {n: graph_plan_for(plans, n).max_context for n in (1, 128, 129, 256, 257, 2048, 2049, 4096, 9999)}
    assert picked == {1: 128, 128: 128, 129: 256, 256: 256, 257: 2048, 2048: 2048, 2049: 4096, 4096: 4096,
                      9999: 4096}
