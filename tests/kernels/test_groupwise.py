"""GGUF blocks repacked into the group-wise layouts: exact against gguf.quants; the Triton kernel (GEMV and
tensor-core paths, every candidate config the tuner may pick) against the torch reference; the candidates valid for
their format and K, the plan among them; tuning keyed by format."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from brrr.gguf.repack import repack_groupwise
from brrr.kernels.quant import TUNED_CONFIGS, quant_tuning
from brrr.kernels.quant.groupwise import dequantize_groupwise, groupwise_matmul_ref, groupwise_matmul_triton
from brrr.kernels.quant.groupwise_configs import (GROUPWISE_GROUPS, config_error, group_step, groupwise_candidates,
                                                  groupwise_config, groupwise_family)
from brrr.kernels.quant.tune import bucket
from tests.kernels.test_quant_tune import Spy

N, K = 32, 512
TYPES = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K]


def _blocks(qtype, seed=0, n=N, k=K):
    """Random valid block bytes (fp16 d / dmin set to finite values) for an [n, k] tensor."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    fp16_at = {T.Q8_0: [0], T.Q6_K: [208], T.Q5_K: [0, 2], T.Q4_K: [0, 2]}[qtype]
    for off in fp16_at:
        b[:, off:off + 2] = rng.uniform(0.001, 0.02, size=(b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return b


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_values_equal_gguf_dequantize(qtype):
    b = _blocks(qtype)
    want = torch.from_numpy(quants.dequantize(b.reshape(N, -1), qtype).astype(np.float32))
    fmt, t = repack_groupwise(torch.from_numpy(b), qtype, N, K)
    got = dequantize_groupwise(fmt, **t)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m, dtype", [(1, torch.float32), (3, torch.bfloat16), (16, torch.float32)])
def test_kernel_matches_reference(device, qtype, m, dtype):
    fmt, t = repack_groupwise(torch.from_numpy(_blocks(qtype, 1)), qtype, N, K)
    t = {k: v.to(device) for k, v in t.items()}
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    bias = torch.randn(N).to(device, dtype)
    want = groupwise_matmul_ref(x, fmt, **t, bias=bias).float()
    got = groupwise_matmul_triton(x, fmt, **t, bias=bias).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((got - want).norm() / want.norm()).item() < tol


def _layer(device, qtype, n, k):
    fmt, t = repack_groupwise(torch.from_numpy(_blocks(qtype, 1, n, k)), qtype, n, k)
    return fmt, {name: v.to(device) for name, v in t.items()}


def _close(got, want, tol):
    return ((got.float() - want.float()).norm() / want.float().norm()).item() < tol


# The candidates of a 48 x 512 layer on a 132-SM GPU (N not a multiple of BLOCK_N; K long enough for split K) at
# M = 1, 2, 3 (the GEMVs' BLOCK_M 1, 2, 4 and the 16-row tiles) and 128 (tiles of 16-128 rows). Run: a sample
# holding every flag combination (DOT, SPLIT > 1) with each of its BLOCK_M, BLOCK_N and BLOCK_K values at least
# once; warps and stages change only the GPU's schedule, not what the interpreter computes.
CAND_N, CAND_K, CAND_MS = 48, 512, (1, 2, 3, 128)


def _sample(fmt):
    """[(rows, config)]: each config with rows = its M, capped at BLOCK_M + 1 (a partial second row block)."""
    seen, out = set(), []
    for m in CAND_MS:
        for cfg in groupwise_candidates(m, CAND_N, CAND_K, fmt, sms=132):
            flags = (cfg["DOT"], cfg["SPLIT"] > 1)
            new = {(flags, name, cfg[name]) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")} - seen
            if new:
                seen |= new
                out.append((min(m, cfg["BLOCK_M"] + 1), cfg))
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_candidate_configs_match_reference(device, qtype):
    fmt, t = _layer(device, qtype, CAND_N, CAND_K)
    x = torch.randn(max(CAND_MS), CAND_K, generator=torch.Generator().manual_seed(3)).to(device)
    want = groupwise_matmul_ref(x, fmt, **t)
    sample = _sample(fmt)
    assert {(c["DOT"], c["SPLIT"] > 1) for _, c in sample} == {(False, False), (False, True), (True, False),
                                                               (True, True)}
    for rows, cfg in sample:
        assert _close(groupwise_matmul_triton(x[:rows], fmt, **t, config=cfg), want[:rows], 1e-4), cfg


@pytest.mark.parametrize("fmt", list(GROUPWISE_GROUPS))
def test_candidates_are_valid_start_with_the_plan_and_are_shared_by_a_bucket(fmt):
    step = 64 if fmt == "q4_k" else 256  # q8_0 K: whole 32-column blocks; the K-quants: whole super-blocks
    for n, k in [(4096, 4096), (1024, 14336), (6144, 4 * step + (32 if fmt == "q8_0" else 0)), (40, step)]:
        by_bucket = {}
        for m in [1, 2, 3, 4, 5, 16, 17, 33, 63, 64, 100, 128, 300, 4096, 9000]:
            cands = groupwise_candidates(m, n, k, fmt)
            assert cands[0] == groupwise_config(m, n, k, fmt)
            assert [c for c in cands if config_error(c, fmt, k)] == []
            assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
            launches = by_bucket.setdefault(bucket(m), {tuple(sorted(c.items())) for c in cands})
            assert {tuple(sorted(c.items())) for c in cands} == launches  # every M of a bucket: the same set
            assert all(c["BLOCK_M"] <= max(16, bucket(m)) for c in cands[1:])
            # the brief's dimensions: GEMV rows 16-128 and warps 2-8 at M <= 4, tiles of 16-128 rows above
            if m == 1 and n == 4096:
                gemvs = [c for c in cands if not c["DOT"]]
                assert {c["BLOCK_N"] for c in gemvs} == {16, 32, 64, 128}
                assert {c["num_warps"] for c in gemvs} == {2, 4, 8} and max(c["SPLIT"] for c in gemvs) == 16
            if m == 128 and n == 4096:
                assert {c["BLOCK_M"] for c in cands} == {16, 32, 64, 128}
                assert {c["BLOCK_K"] for c in cands} == {64, 128}


def test_config_error_names_what_a_format_and_k_cannot_run():
    plan = groupwise_config(1, 64, 512, "q4_k")
    assert config_error(plan, "q4_k", 512) is None
    assert "group step 64" in config_error(dict(plan, BLOCK_K=32), "q4_k", 512)
    assert config_error(dict(plan, BLOCK_K=32), "q8_0", 512) is None  # one Q8_0 block
    assert "group step 16" in config_error(dict(plan, BLOCK_K=8), "q6_k", 512)
    assert "BLOCK_K x SPLIT = 1024" in config_error(dict(plan, BLOCK_K=256, SPLIT=4), "q6_k", 512)
    assert "power of two" in config_error(dict(plan, BLOCK_N=48), "q8_0", 512)
    assert "1..16" in config_error(dict(plan, SPLIT=32, BLOCK_K=16), "q6_k", 512)
    assert "tl.dot" in config_error(dict(plan, DOT=True), "q8_0", 512)  # a 1-row tile
    assert config_error(dict(plan, DOT=True, BLOCK_M=16, BLOCK_K=16), "q6_k", 512) is None
    assert config_error(dict(plan, DOT=True, BLOCK_M=16, BLOCK_K=64), "q4_k", 512) is None  # dots of 32 columns
    assert group_step("q4_k") == 64 and group_step("q6_k") == 16


def test_a_forced_invalid_config_is_refused(device):
    fmt, t = _layer(device, T.Q4_K, 32, 512)
    x = torch.randn(1, 512).to(device)
    with pytest.raises(ValueError, match="group step 64"):
        groupwise_matmul_triton(x, fmt, **t, config=dict(groupwise_config(1, 32, 512, fmt), BLOCK_K=32))


def test_tuning_is_keyed_by_format_and_untuned_shapes_run_the_plan(device):
    """A q4_k and a q6_k layer of one shape (a Q4_K_M file's attn_q and attn_v) are tuned apart; the pick runs and
    matches the reference; a shape never tuned runs the plan without timing."""
    n, k = 64, 512
    layers = {qtype: _layer(device, qtype, n, k) for qtype in (T.Q4_K, T.Q6_K)}
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    sms = 1 if device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    wide = lambda c: not c["DOT"] and c["BLOCK_N"] == 64 and c["num_warps"] == 8  # noqa: E731
    TUNED_CONFIGS.clear()
    try:
        spy = Spy(wide)
        with quant_tuning(timer=spy) as report:
            for fmt, t in layers.values():
                assert _close(groupwise_matmul_triton(x, fmt, **t), groupwise_matmul_ref(x, fmt, **t), 2e-2)
        assert [s.shape[:2] for s in report.shapes] == [("gguf", "q4_k"), ("gguf", "q6_k")]
        for s, (fmt, _) in zip(report.shapes, layers.values()):
            # the coordinate search: each family's first candidate, then the rest of the fastest family's
            cands, heads = groupwise_candidates(1, n, k, fmt, sms), {}
            for c in cands:
                heads.setdefault(groupwise_family(c), c)
            heads = list(heads.values())
            best = next(c for c in heads if wide(c))
            rest = [c for c in cands if groupwise_family(c) == groupwise_family(best) and c not in heads]
            assert [c for c, _ in s.timings] == heads + rest and rest and s.config == best
            assert len(s.timings) < len(cands)
        assert spy.calls == sum(len(s.timings) for s in report.shapes)

        fmt, t = layers[T.Q6_K]
        key = ("gguf", fmt, n, k, torch.bfloat16)
        never = ("gguf", fmt, n, 2 * k, torch.bfloat16)
        after = Spy(lambda c: True)  # as the run: outside a session nothing is timed or run
        cands = lambda: groupwise_candidates(1, n, k, fmt, sms)  # noqa: E731
        plan = groupwise_config(1, n, 2 * k, fmt, sms)
        assert TUNED_CONFIGS.config(x.device, key, 1, cands, after, default=plan) == report.shapes[1].config
        assert TUNED_CONFIGS.config(x.device, never, 1, cands, after, default=plan) == plan
        assert after.calls == 0
    finally:
        TUNED_CONFIGS.clear()
