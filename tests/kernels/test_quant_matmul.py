"""W4A16 / W8A16 matmul kernels and per-token activation quantization: Triton against the torch references.

On the CPU they run under Triton's interpreter, where the kernels take their portable paths (plain casts of the
codes, fp32 dot products); the inline-PTX dequantization runs only on the GPU (tests/gpu/test_quant_cuda.py).
Shapes are small and odd on purpose: M = 1, 3 (decode path), 17 (tiled path); N not a multiple of the column
tile; K a multiple of the group size but not of the columns one iteration reads, so the last iteration is partial;
split K forced on some cases (the last program of a tile adds the partial sums). The GEMV candidates (M <= 4, CUDA
cores) run here with their portable dequantization (plain shifts and masks; the GPU takes prmt for the same bits)
at M = 1-4 for every group size, int4 symmetric and asymmetric, int8, K not a multiple of the int8 step, N a multiple
of BLOCK_N or not, fp32/bf16/fp16 inputs, with and without bias."""
import pytest
import torch

from brrr.kernels import quant as qm
from brrr.kernels.quant import configs as cfgs, launch, layouts, tune

# (group size, M, symmetric, config index): the decode path's first config splits K ("auto"); its last tensor-core
# config (LAST_TC) does not
LAST_TC = len(qm.CANDIDATES.small) - 1
W4_CASES = [(32, 1, False, 0), (32, 3, True, LAST_TC), (32, 17, False, 0), (64, 1, True, 0), (64, 3, False, LAST_TC),
            (64, 17, True, 2), (128, 1, False, LAST_TC), (128, 3, False, 0), (128, 17, False, 3)]


def _w4_problem(group, m, symmetric, n=40, groups=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = group * groups
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(groups, n, generator=g) * 0.1 + 0.01).to(dtype if dtype == torch.bfloat16 else torch.float32)
    zeros = None if symmetric else torch.randint(0, 16, (groups, n), generator=g).to(torch.uint8)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, qm.pack_int4_kernel(codes, group), scales, zeros, bias, codes


def test_int4_kernel_layout_packs_each_group_s_halves_into_low_and_high_nibbles():
    codes = torch.randint(0, 16, (3, 128), generator=torch.Generator().manual_seed(1))
    packed = qm.pack_int4_kernel(codes, 64)
    assert packed.shape == (3, 64) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0].to(torch.uint8))
    assert torch.equal(packed[:, 0] >> 4, codes[:, 32].to(torch.uint8))  # column j + g/2 of group 0
    assert torch.equal(packed[:, 32] & 0xF, codes[:, 64].to(torch.uint8))  # group 1 starts at byte g/2
    assert torch.equal(qm.unpack_int4_kernel(packed, 64), codes.to(torch.uint8))


def test_chunk_major_stores_every_row_s_first_64_bytes_then_the_next():
    codes = torch.randint(0, 16, (5, 256), generator=torch.Generator().manual_seed(2))
    packed = qm.pack_int4_kernel(codes, 32)
    chunked = qm.chunk_major(packed)
    assert chunked.shape == (5, 2, 64) and chunked.stride() == (64, 5 * 64, 1)  # chunk c of row n at c*320 + n*64
    assert torch.equal(chunked.reshape(5, 128), packed) and torch.equal(qm.unpack_int4_kernel(chunked, 32), codes)
    assert layouts.packed_strides(chunked) == (64, 320) and layouts.packed_strides(packed) == (128, 64)
    assert layouts.packed_strides(layouts.int32_words(chunked)) == (16, 80) and layouts.packed_strides(layouts.int32_words(packed)) == (32, 16)
    rows = qm.pack_int4_kernel(codes[:, :96], 32)  # 48 bytes a row: not whole chunks, stays by rows
    assert qm.chunk_major(rows) is rows


@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_w4_kernel_reads_the_chunk_major_layout(device, group):
    """One candidate of each int4 family (tensor-core decode, MMA decode, GEMV, MMA GEMV, tiled, mid-M split K,
    dequantize) gives the same bits from the chunk-major view as from rows. K = 384: 3 chunks of 12 / 6 / 3 groups,
    so g32 and g64 groups also start inside a chunk."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(group, 33, False, groups=384 // group)
    x, qweight, scales, zeros, bias = (t.to(device) for t in (x, qweight, scales, zeros, bias))
    chunked = qm.chunk_major(qweight)
    assert chunked.dim() == 3
    decode = qm.w4_configs(1, group)
    cases = [(1, decode[0]), (1, next(c for c in decode if c.get("MMA"))), (1, _gemv(1, 0)),
             (17, qm.w4_configs(17, group)[0]), (33, dict(qm.w4_configs(33, group)[len(qm.CANDIDATES.tiled)], SPLIT_K=2))]
    cases += [(1, dict(cfgs.mma_gemv_configs(1, 128)[0], SPLIT_K=2))] if group == 128 else []
    for m, cfg in cases:
        by_rows = qm.w4a16_matmul_triton(x[:m], qweight, scales, zeros, group, bias, config=cfg)
        assert torch.equal(qm.w4a16_matmul_triton(x[:m], chunked, scales, zeros, group, bias, config=cfg), by_rows), cfg
    assert torch.equal(qm.dequantize_w4_triton(chunked, scales, zeros, group, torch.float32),
                       qm.dequantize_w4_triton(qweight, scales, zeros, group, torch.float32))


@pytest.mark.parametrize("group,m,symmetric,cfg", W4_CASES)
def test_w4a16_kernel_matches_reference(device, group, m, symmetric, cfg):
    x, qweight, scales, zeros, bias, _ = _w4_problem(group, m, symmetric)
    x, qweight, scales, bias = (t.to(device) for t in (x, qweight, scales, bias))
    zeros = None if zeros is None else zeros.to(device)
    config = qm.w4_configs(m, group)[cfg]
    got = qm.w4a16_matmul_triton(x, qweight, scales, zeros, group, bias, config=config)
    want = qm.w4a16_matmul_ref(x, qweight, scales, zeros, group, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group,m,symmetric,dtype", [(128, 5, False, torch.float32), (64, 17, True, torch.float32),
                                                     (128, 70, False, torch.bfloat16), (32, 140, False, torch.float32)])
def test_w4a16_swapped_tiles_match_reference(device, group, m, symmetric, dtype):
    """The swapped tiles (y^T = W x^T, the weight tile as the MMA's left operand) of M's range: N = 40 (a partial
    tile), 5 groups, M below the tile's rows; every candidate whose rows fit M, split K forced on the first."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(group, m, symmetric, dtype=dtype)
    x, qweight, scales, bias = (t.to(device) for t in (x, qweight, scales, bias))
    zeros = None if zeros is None else zeros.to(device)
    swapped = [c for c in qm.w4_configs(m, group) if c.get("SWAP")]
    assert swapped and swapped == cfgs.swap_configs(m, group)
    for i, cfg in enumerate(swapped[:2]):
        got = qm.w4a16_matmul_triton(x, qweight, scales, zeros, group, bias, config=dict(cfg, SPLIT_K=2) if i == 0
                                     else cfg)
        want = qm.w4a16_matmul_ref(x.float(), qweight, scales.float(), zeros, group, bias.float())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:
            assert _rel(got, want) < 8e-3, cfg


MMA_CASES = [(32, 1, False, 0, torch.float32), (64, 3, True, 4, torch.bfloat16), (128, 16, False, 5, torch.float32),
             (128, 1, True, 2, torch.bfloat16), (128, 5, False, 1, torch.float16)]


@pytest.mark.parametrize("group,m,symmetric,index,dtype", MMA_CASES)
def test_w4a16_mma_decode_kernel_matches_reference(device, group, m, symmetric, index, dtype):
    """The MMA decode candidates: rows and K relabeled for the MMA (`_mma_order`), N = 300 (a partial column tile),
    5 groups (a partial pair of groups), split K forced on some. Under the interpreter the codes come from plain
    casts and the products from fp32 dots."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(group, m, symmetric, n=300, dtype=dtype)
    x, qweight, scales, bias = (t.to(device) for t in (x, qweight, scales, bias))
    zeros = None if zeros is None else zeros.to(device)
    cfg = [c for c in qm.w4_configs(m, group) if c.get("MMA")][index]
    cfg = dict(cfg, SPLIT_K=2) if index % 2 == 0 else cfg
    got = qm.w4a16_matmul_triton(x, qweight, scales, zeros, group, bias, config=cfg)
    want = qm.w4a16_matmul_ref(x.float(), qweight, scales, zeros, group, bias.float())
    tol = 1e-4 if dtype == torch.float32 else 8e-3  # 16-bit: the output's rounding
    assert got.dtype == dtype and (got.float() - want).abs().max() <= tol * want.abs().max(), cfg


def test_w4a16_reference_is_the_dequantized_weight():
    x, qweight, scales, zeros, bias, codes = _w4_problem(32, 2, False)
    w = ((codes.view(40, 5, 32) - zeros.t().float()[:, :, None]) * scales.t()[:, :, None]).view(40, 160)
    torch.testing.assert_close(qm.w4a16_matmul_ref(x, qweight, scales, zeros, 32, bias), x @ w.T + bias)


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("m", [1, 17])
def test_w4a16_bf16(device, m):
    """bf16: the kernel multiplies exact codes and applies each group's scale to the fp32 partial sum, the
    reference rounds each dequantized weight to bf16 first; they agree to bf16 precision."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(128, m, False, dtype=torch.bfloat16)
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = qm.w4a16_matmul_triton(*args, 128, bias.to(device))
    assert got.dtype == torch.bfloat16 and _rel(got, qm.w4a16_matmul_ref(*args, 128, bias.to(device))) < 1e-2


# ---- M > 16: mid-M split-K tiles and dequantize-then-F.linear ------------------------------------------------------
def test_large_m_candidates():
    """Above the small-M path: the tiled configs (the untimed default first), the mid-M split-K tiles up to MID_M,
    and dequantize-then-F.linear last; at most the tiled ones and the dequantize one beyond MID_M."""
    for configs in (qm.w4_configs(64, 128), qm.w8_configs(64)):
        plain = [c for c in configs if not c.get("SWAP")]  # int4's swapped tiles come last
        assert plain[-1] == qm.DEQUANT and configs[0]["SPLIT_K"] == 1 and configs[0]["BLOCK_M"] >= 64
        assert len(plain) == len(qm.CANDIDATES.tiled) + len(qm.CANDIDATES.mid) + 1 and configs[:len(plain)] == plain
    assert (len(qm.w4_configs(qm.LIMITS.mid_m + 1, 128)) - len(cfgs.swap_configs(qm.LIMITS.mid_m + 1, 128))
            == len(qm.w8_configs(4096)) == len(qm.CANDIDATES.tiled) + 1)
    assert [c["BLOCK_M"] for c in cfgs.swap_configs(64, 128)] == [32, 64, 64] and not cfgs.swap_configs(qm.LIMITS.gemv_m, 128)
    assert qm.DEQUANT not in qm.w4_configs(16, 128) + qm.w8_configs(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True)])
def test_dequantize_w4_kernel_is_the_reference_rounded_once(device, dtype, group, symmetric):
    _, qweight, scales, zeros, _, _ = _w4_problem(group, 1, symmetric, n=70, dtype=dtype)
    args = [t if t is None else t.to(device) for t in (qweight, scales, zeros)]
    got = qm.dequantize_w4_triton(*args, group, dtype)
    want = qm.dequantize_w4(qweight, scales, zeros, group).to(dtype)
    assert got.dtype == dtype
    if dtype == torch.float32 or (device == "cuda" and dtype == torch.bfloat16):
        assert torch.equal(got.cpu(), want)
    else:  # one unit apart: the interpreter truncates fp32 -> bf16; fp16 on the GPU rounds the fp32 scale first
        torch.testing.assert_close(got.cpu(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_w8_kernel_is_the_reference_rounded_once(device, dtype):
    _, q, scales, _ = _w8_problem(1, n=45, k=300)
    got, want = qm.dequantize_w8_triton(q.to(device), scales.to(device), dtype).cpu(), (q.float() * scales[:, None])
    if device == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        torch.testing.assert_close(got, want.to(dtype), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("which", ["mid", "dequant"])
def test_large_m_paths_match_reference(device, which):
    """M = 33: a mid-M config with split K forced, and the dequantize candidate, for int4 (asymmetric) and int8."""
    cfg_w4 = dict(qm.w4_configs(33, 32)[len(qm.CANDIDATES.tiled)], SPLIT_K=2) if which == "mid" else qm.DEQUANT
    cfg_w8 = dict(qm.w8_configs(33)[len(qm.CANDIDATES.tiled) + 1], SPLIT_K=3) if which == "mid" else qm.DEQUANT
    x, qweight, scales, zeros, bias, _ = _w4_problem(32, 33, False)
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = qm.w4a16_matmul_triton(*args, 32, bias.to(device), config=cfg_w4)
    torch.testing.assert_close(got, qm.w4a16_matmul_ref(*args, 32, bias.to(device)), rtol=1e-5, atol=1e-4)
    x, q, s, bias = (t.to(device) for t in _w8_problem(33))
    got = qm.w8a16_matmul_triton(x, q, s, bias, config=cfg_w8)
    torch.testing.assert_close(got, qm.w8a16_matmul_ref(x, q, s, bias), rtol=1e-5, atol=1e-4)


def _w8_problem(m, n=40, k=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-3
    return torch.randn(m, k, generator=g).to(dtype), q, scales, torch.randn(n, generator=g).to(dtype)


def test_every_w8_kernel_reads_the_chunk_major_layout(device):
    """Weight-only int8 is stored chunk-major too: each W8A16 family (tensor-core decode with 256-column tiles, so
    the last one is partial at K = 384; GEMV; tiled; mid-M split K; dequantize) gives the same bits from both."""
    x, q, scales, bias = (t.to(device) for t in _w8_problem(33, k=384))
    chunked = qm.chunk_major(q)
    assert chunked.shape == (40, 6, 64) and torch.equal(chunked.reshape(40, 384), q)
    cases = [(1, qm.w8_configs(1)[0]), (1, _gemv(1, 0)), (2, _gemv(2, 3)), (17, qm.w8_configs(17)[0]),
             (33, dict(qm.w8_configs(33)[len(qm.CANDIDATES.tiled) + 1], SPLIT_K=3)),
             (1, dict(cfgs.mma_gemv_w8_configs(1, 384)[0], SPLIT_K=2))]
    for m, cfg in cases:
        by_rows = qm.w8a16_matmul_triton(x[:m], q, scales, bias, config=cfg)
        assert torch.equal(qm.w8a16_matmul_triton(x[:m], chunked, scales, bias, config=cfg), by_rows), cfg
    assert torch.equal(qm.dequantize_w8_triton(chunked, scales, torch.float32),
                       qm.dequantize_w8_triton(q, scales, torch.float32))
    torch.testing.assert_close(qm.w8a16_matmul_ref(x, chunked, scales), qm.w8a16_matmul_ref(x, q, scales))


@pytest.mark.parametrize("m,cfg,with_bias", [(1, 0, True), (3, LAST_TC, False), (17, 0, True), (17, 3, False)])
def test_w8a16_kernel_matches_reference(device, m, cfg, with_bias):
    x, q, scales, bias = (t.to(device) for t in _w8_problem(m))
    bias = bias if with_bias else None
    got = qm.w8a16_matmul_triton(x, q, scales, bias, config=qm.w8_configs(m)[cfg])
    torch.testing.assert_close(got, qm.w8a16_matmul_ref(x, q, scales, bias), rtol=1e-5, atol=1e-4)


def test_w8a16_bf16(device):
    x, q, scales, bias = (t.to(device) for t in _w8_problem(3, dtype=torch.bfloat16))
    got = qm.w8a16_matmul_triton(x, q, scales, bias)
    assert got.dtype == torch.bfloat16 and _rel(got, qm.w8a16_matmul_ref(x, q, scales, bias)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_int8_quantization_is_exact(device, dtype):
    """Same codes (round half to even) and scales as the reference; a zero row gets the smallest scale."""
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[1] = 0
    x[3, :4] = torch.tensor([0.5, -1.5, 2.5, 127.0]).to(dtype)  # ties, once the scale is 1
    x[3, 4:] = 0
    q, s = qm.quantize_per_token_triton(x.to(device), torch.int8)
    q_ref, s_ref = qm.quantize_per_token_ref(x, torch.int8)
    assert q.dtype == torch.int8 and s.shape == (5, 1)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    assert q_ref[3, :4].tolist() == [0, -2, 2, 127]


def test_per_token_fp8_scales(device):
    """Scales are exact here; the codes are compared on the GPU only: Triton's interpreter converts fp32 -> E4M3
    wrongly when rounding carries into the exponent (124.3 becomes 64, not 128)."""
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(3)) * 5
    q, s = qm.quantize_per_token_triton(x.to(device), torch.float8_e4m3fn)
    q_ref, s_ref = qm.quantize_per_token_ref(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s.cpu(), s_ref)
    if device == "cuda":
        assert torch.equal(q.cpu().float(), q_ref.float())


# ---- GEMV path (M <= 4) ---------------------------------------------------------------------------------------------
def _gemv(m, index):
    """The GEMV candidate `index` (mod their count) for M = m, with a small BLOCK_N: the interpreter's cost grows with
    the tile, and BLOCK_N = 64 against N = 64 takes the unmasked (EVEN_N) path."""
    configs = cfgs.gemv_configs(m)
    return dict(configs[index % len(configs)], BLOCK_N=min(64, configs[index % len(configs)]["BLOCK_N"]))


def test_gemv_candidates_join_the_small_m_tuning_only():
    """M <= 4: the tensor-core candidates first (the untimed default is unchanged), then the GEMV ones; each M <= 4 is
    its own tuning bucket; M > 4 has no GEMV candidate; a qweight whose rows are not 4-byte aligned gets none."""
    for m in (1, 2, 3, 4):
        w4, w8 = qm.w4_configs(m, 128), qm.w8_configs(m)
        base = [c for c in qm.w4_configs(16, 128) if not c.get("SWAP")]  # swapped tiles from M = 5
        assert w4[:len(base)] == base
        assert [c for c in w4 if "CHUNKS" in c] == [c for c in w8 if "CHUNKS" in c] == cfgs.gemv_configs(m) != []
        assert "CHUNKS" not in w4[0] and "CHUNKS" not in w8[0]
        assert all(c["ROWS"] == m and c["BLOCK_M"] >= m for c in cfgs.gemv_configs(m))
    assert not cfgs.gemv_configs(5) and not any("CHUNKS" in c for c in qm.w4_configs(5, 128) + qm.w8_configs(16))
    assert len({tune.bucket(m) for m in (1, 2, 3, 4, 5, 16)}) == 5 and tune.bucket(5) == tune.bucket(16)
    odd = torch.zeros(8, 67, dtype=torch.uint8)[:, 1:]  # rows 67 bytes apart
    assert layouts.int32_words(odd) is None and layouts.int32_words(torch.zeros(8, 64, dtype=torch.uint8)).shape == (8, 16)


# (group, M, symmetric, N, with bias, config index)
GEMV_W4_CASES = [(g, m, sym, n, bias, i) for i, (g, m, sym, n, bias) in enumerate(
    [(32, 1, True, 40, True), (32, 2, False, 64, False), (32, 3, True, 64, True), (32, 4, False, 40, False),
     (64, 1, False, 64, False), (64, 2, True, 40, True), (64, 3, False, 40, False), (64, 4, True, 64, True),
     (128, 1, False, 40, True), (128, 1, True, 64, False), (128, 2, False, 40, False), (128, 3, True, 40, True),
     (128, 4, False, 64, True)])]


@pytest.mark.parametrize("group,m,symmetric,n,with_bias,index", GEMV_W4_CASES)
def test_w4a16_gemv_matches_reference(device, group, m, symmetric, n, with_bias, index):
    """fp32: exact codes, fp32 products and sums; only the summation order differs from the reference."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(group, m, symmetric, n=n, groups=3)
    x, qweight, scales, bias = (t.to(device) for t in (x, qweight, scales, bias))
    zeros = None if zeros is None else zeros.to(device)
    bias = bias if with_bias else None
    got = qm.w4a16_matmul_triton(x, qweight, scales, zeros, group, bias, config=_gemv(m, index))
    torch.testing.assert_close(got, qm.w4a16_matmul_ref(x, qweight, scales, zeros, group, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k,n,with_bias,index", [(1, 300, 40, True, 0), (2, 320, 64, False, 1), (3, 300, 64, True, 2),
                                                   (4, 256, 40, False, 0), (1, 256, 64, False, 6)])
def test_w8a16_gemv_matches_reference(device, m, k, n, with_bias, index):
    """K = 300: the last 16-byte step is partial (masked by word); 256, 320: whole steps."""
    x, q, scales, bias = (t.to(device) for t in _w8_problem(m, n=n, k=k))
    q[0, :4] = -128  # the one code outside the format's [-127, 127] the bit trick must still get right
    bias = bias if with_bias else None
    got = qm.w8a16_matmul_triton(x, q, scales, bias, config=_gemv(m, index))
    torch.testing.assert_close(got, qm.w8a16_matmul_ref(x, q, scales, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_16_bit_inputs(device, dtype, m):
    """bf16/fp16 x (bf16 scales with bf16): the GEMV computes with the exact dequantized weight in fp32, the reference
    rounds it to the input dtype first; they agree to that rounding."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(128, m, False, dtype=dtype, groups=3)
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = qm.w4a16_matmul_triton(*args, 128, bias.to(device), config=_gemv(m, m))
    assert got.dtype == dtype and _rel(got, qm.w4a16_matmul_ref(*args, 128, bias.to(device))) < 1e-2
    x, q, s, bias = (t.to(device) for t in _w8_problem(m, dtype=dtype))
    got = qm.w8a16_matmul_triton(x, q, s, bias, config=_gemv(m, m))
    assert got.dtype == dtype and _rel(got, qm.w8a16_matmul_ref(x, q, s, bias)) < 1e-2


def test_gemv_rejects_unaligned_weight_rows(device):
    x, q, scales, _ = _w8_problem(1, k=301)
    with pytest.raises(ValueError, match="multiple of 4"):
        qm.w8a16_matmul_triton(x.to(device), q.to(device), scales.to(device), config=_gemv(1, 0))
    # the tuned path simply has no GEMV candidate there and takes the tensor-core kernel
    got = qm.w8a16_matmul_triton(x.to(device), q.to(device), scales.to(device))
    torch.testing.assert_close(got, qm.w8a16_matmul_ref(x, q, scales).to(device), rtol=1e-5, atol=1e-4)


# ---- MMA GEMV path (M = 1, int4 g128) -------------------------------------------------------------------------------
def _fills_warps(cfg) -> bool:
    """A tile's rows (BLOCK_N / 2 outputs x KW slices) fill whole warps, 8 rows a warp, and a warp's rows share one
    K slice."""
    return cfg["BLOCK_N"] // 2 * cfg["KW"] % (8 * cfg["num_warps"]) == 0 and cfg["num_warps"] % cfg["KW"] == 0


def test_mma_gemv_candidates_only_for_one_row_and_group_128():
    """After the GEMV ones, for M = 1 and g128 only (the MMA's K relabeling needs a 16-word group row)."""
    configs = qm.w4_configs(1, 128)
    assert [c for c in configs if c.get("MMA_GEMV")] == cfgs.mma_gemv_configs(1, 128) != []
    assert configs.index(cfgs.mma_gemv_configs(1, 128)[0]) > max(i for i, c in enumerate(configs) if "CHUNKS" in c)
    assert not any(c.get("MMA_GEMV") for c in qm.w4_configs(2, 128) + qm.w4_configs(1, 64))
    assert all(_fills_warps(c) for c in cfgs.mma_gemv_configs(1, 128))


@pytest.mark.parametrize("symmetric,n,with_bias,split,dtype", [
    (False, 40, True, 1, torch.float32), (True, 100, False, 2, torch.float32), (False, 64, False, 3, torch.bfloat16),
    (True, 130, True, 1, torch.float16)])
def test_w4a16_mma_gemv_matches_reference(device, symmetric, n, with_bias, split, dtype):
    """N = 40, 100, 130: rows past N (their loads clamped to row N - 1) are not stored; split K over 3 groups. On the
    CPU the portable path (fp32 sums of exact codes); bf16/fp16 on the GPU the mma.sync one."""
    x, qweight, scales, zeros, bias, _ = _w4_problem(128, 1, symmetric, n=n, groups=3, dtype=dtype)
    x, qweight, scales, bias = (t.to(device) for t in (x, qweight, scales, bias))
    zeros = None if zeros is None else zeros.to(device)
    bias = bias if with_bias else None
    cfg = dict(cfgs.mma_gemv_configs(1, 128)[0], SPLIT_K=split)
    got = qm.w4a16_matmul_triton(x, qweight, scales, zeros, 128, bias, config=cfg)
    want = qm.w4a16_matmul_ref(x.float(), qweight, scales.float(), zeros, 128,
                               None if bias is None else bias.float())
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert _rel(got, want) < 8e-3


# ---- W8A16 MMA GEMV path (M = 1, K a multiple of 64) -----------------------------------------------------------------
def test_w8_mma_gemv_candidates_only_for_one_row_and_k_in_steps_of_64():
    configs = qm.w8_configs(1, k=4096)
    assert [c for c in configs if c.get("MMA_GEMV")] == cfgs.mma_gemv_w8_configs(1, 4096) != []
    assert configs.index(cfgs.mma_gemv_w8_configs(1, 4096)[0]) > max(i for i, c in enumerate(configs) if "CHUNKS" in c)
    assert not any(c.get("MMA_GEMV") for c in qm.w8_configs(2, k=4096) + qm.w8_configs(1, k=300))
    assert all(_fills_warps(c) for c in cfgs.mma_gemv_w8_configs(1, 64))
    x, q, scales, _ = _w8_problem(1, k=300)
    with pytest.raises(ValueError, match="steps of 64"):
        qm.w8a16_matmul_triton(x, q, scales, config=cfgs.mma_gemv_w8_configs(1, 64)[0])


@pytest.mark.parametrize("n,k,with_bias,split,dtype", [
    (40, 192, True, 1, torch.float32), (100, 320, False, 2, torch.float32), (64, 192, False, 3, torch.bfloat16),
    (130, 128, True, 1, torch.float16)])
def test_w8a16_mma_gemv_matches_reference(device, n, k, with_bias, split, dtype):
    """Codes over the whole int8 range (-128 too); rows past N not stored; split K over 3 steps. On the CPU the
    portable path; bf16/fp16 on the GPU the mma.sync one, whose codes are exact and sums fp32."""
    x, q, scales, bias = _w8_problem(1, n=n, k=k, dtype=dtype)
    q[0, :8] = torch.tensor([-128, 127, -1, 0, 1, -127, 64, -64], dtype=torch.int8)
    x, q, scales, bias = (t.to(device) for t in (x, q, scales, bias))
    bias = bias if with_bias else None
    cfg = dict(cfgs.mma_gemv_w8_configs(1, k)[0], SPLIT_K=split)
    got = qm.w8a16_matmul_triton(x, q, scales, bias, config=cfg)
    want = qm.w8a16_matmul_ref(x.float(), q, scales, None if bias is None else bias.float())
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert _rel(got, want) < 8e-3


def _fp8_problem(m, n=40, k=512, dtype=torch.float32, seed=0):
    """E4M3 weights holding every finite code (subnormals, both zeros, +-448) and a scale per row."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g)
    codes[:2, :256] = torch.arange(256)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN: the quantizer never writes one
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(n, generator=g) * 0.01 + 1e-3
    return torch.randn(m, k, generator=g).to(dtype), q, scales, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_weights_run_every_w8_family_but_the_cuda_core_gemv(device, dtype):
    """Weight-only FP8 (float8_e4m3fn bytes, chunk-major) through the W8A16 kernels: tensor-core decode, the MMA
    GEMV (one warp a K slice and K split across warps), tiled, mid-M split K and dequantize, against the reference
    on E4M3's every finite code. On the GPU in bf16 the MMA GEMV converts by bit moves and a multiply by 2^120
    (E4M3's subnormals pass through bf16's), in fp16 by cvt."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter's portable paths are covered in fp32")
    x, q, scales, bias = (t.to(device) for t in _fp8_problem(33, dtype=dtype))
    chunked = qm.chunk_major(q)
    mma = cfgs.mma_gemv_w8_configs(1, 512)
    cases = [(1, dict(mma[0], SPLIT_K=2)), (1, next(c for c in mma if c["KW"] > 1)), (3, qm.w8_configs(3)[0]),
             (17, qm.w8_configs(17)[0]), (33, dict(qm.w8_configs(33)[len(qm.CANDIDATES.tiled) + 1], SPLIT_K=3)),
             (33, qm.DEQUANT)]
    for m, cfg in cases:
        got = qm.w8a16_matmul_triton(x[:m], chunked, scales, bias, config=cfg)
        want = qm.w8a16_matmul_ref(x[:m].float(), q, scales, bias.float())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=str(cfg))
        else:
            assert got.dtype == dtype and _rel(got, want) < 8e-3, cfg
    exact = qm.dequantize_w8_triton(chunked, scales, torch.float32).cpu()
    assert torch.equal(exact, q.cpu().float() * scales.cpu()[:, None])
    assert not any("CHUNKS" in c for c in qm.w8_configs(1, k=512, cuda_core=False))
    with pytest.raises(ValueError, match="CUDA-core GEMV reads int8 codes only"):
        qm.w8a16_matmul_triton(x[:1], chunked, scales, config=_gemv(1, 0))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_mma_gemv_warps_split_k_within_a_program(device, fmt):
    """KW > 1: a program's warps take equal K slices and sum them in shared memory. Every such candidate, alone and
    with split K across programs too (cut down to a split that keeps the slices equal: 16 steps, KW 8, asked for 3
    -> 2), matches the reference; a step count KW does not divide is refused with the numbers."""
    steps = 16
    for cfg in [c for c in (cfgs.mma_gemv_configs(1, 128) if fmt == "int4" else cfgs.mma_gemv_w8_configs(1, 64))
                if c["KW"] > 1 and not c["LAST_STEP_RELEASE"]]:
        for split in (1, 3):
            assert launch.split_k(dict(cfg, SPLIT_K=split), 1, 100, steps, torch.device("cpu")) * cfg["KW"] <= steps
            c = dict(cfg, SPLIT_K=split)
            if fmt == "int4":
                x, w, s, z, b, _ = (t if t is None else t.to(device) for t in _w4_problem(128, 1, False, n=100,
                                                                                          groups=steps))
                got, want = (qm.w4a16_matmul_triton(x, w, s, z, 128, b, config=c),
                             qm.w4a16_matmul_ref(x, w, s, z, 128, b))
            else:
                x, w, s, b = (t.to(device) for t in _w8_problem(1, n=100, k=64 * steps))
                got, want = qm.w8a16_matmul_triton(x, w, s, b, config=c), qm.w8a16_matmul_ref(x, w, s, b)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=str(c))
    with pytest.raises(ValueError, match="KW = 8 warps cannot split 12 K steps"):
        launch.split_k(dict(SPLIT_K=1, KW=8), 1, 100, 12, torch.device("cpu"))


def test_mma_gemv_candidates_come_in_both_release_points(device):
    """Each MMA GEMV config releases the next launch from its epilogue (the default first), then those with KW = 1
    from their last K step. The release changes no output."""
    for both, table in ((cfgs.mma_gemv_w8_configs(1, 64), qm.CANDIDATES.mma_gemv_w8),
                        (cfgs.mma_gemv_configs(1, 128), qm.CANDIDATES.mma_gemv)):
        first = [c for c in both if not c["LAST_STEP_RELEASE"]]
        assert both[:len(first)] == first and len(first) == len(table)
        assert [dict(c, LAST_STEP_RELEASE=False) for c in both[len(first):]] == [c for c in first if c["KW"] == 1]
    x, q, scales, bias = (t.to(device) for t in _w8_problem(1, n=40, k=192))
    cfg = dict(cfgs.mma_gemv_w8_configs(1, 64)[0], SPLIT_K=2)
    assert torch.equal(qm.w8a16_matmul_triton(x, q, scales, bias, config=cfg),
                       qm.w8a16_matmul_triton(x, q, scales, bias, config=dict(cfg, LAST_STEP_RELEASE=True)))


# ---- gate/up with SiLU-and-mul in the MMA GEMV's epilogue (batch-1 decode) ----------------------------------------
@pytest.mark.parametrize("fmt,half,split,with_bias,dtype", [
    ("int8", 40, 1, True, torch.bfloat16), ("int8", 100, 3, False, torch.float16), ("int4", 40, 2, False, torch.bfloat16),
    ("int4", 70, 1, True, torch.float16), ("int8", 64, 2, False, torch.float32)])
def test_gated_mma_gemv_is_the_gemv_then_silu_and_mul(device, fmt, half, split, with_bias, dtype):
    """W = [gate; up] (2 x half rows; half not a multiple of the tile's 64 rows: clamped rows are not stored). The
    fused kernel pairs gate row i with up row i in one program; its output is the unfused MMA GEMV's, rounded,
    through silu_and_mul, bit for bit (same config, same split K)."""
    from brrr.kernels.activation import silu_and_mul_triton, silu_and_mul_ref

    n = 2 * half
    if fmt == "int8":
        x, q, scales, bias = (t.to(device) for t in _w8_problem(1, n=n, k=192, dtype=dtype))
        cfg = dict(cfgs.mma_gemv_w8_configs(1, 192)[0], SPLIT_K=split)
        run = lambda **kw: qm.w8a16_matmul_triton(x, q, scales, bias if with_bias else None, config=cfg, **kw)  # noqa
        ref = qm.w8a16_matmul_ref(x.float(), q, scales.float(), bias.float() if with_bias else None)
    else:
        x, qweight, scales, zeros, bias, _ = _w4_problem(128, 1, False, n=n, groups=3, dtype=dtype)
        x, qweight, scales, zeros, bias = (t.to(device) for t in (x, qweight, scales, zeros, bias))
        cfg = dict(cfgs.mma_gemv_configs(1, 128)[0], SPLIT_K=split)
        run = lambda **kw: qm.w4a16_matmul_triton(x, qweight, scales, zeros, 128, bias if with_bias else None,  # noqa
                                                  config=cfg, **kw)
        ref = qm.w4a16_matmul_ref(x.float(), qweight, scales.float(), zeros, 128,
                                  bias.float() if with_bias else None)
    got = run(gated=True)
    unfused = run()
    assert got.shape == (1, half) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul_triton(*unfused.chunk(2, -1)))
    want = silu_and_mul_ref(*ref.chunk(2, -1))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert _rel(got, want) < 2e-2


def test_gated_dispatch_falls_back_to_the_gemm_then_silu_and_mul():
    """Two rows of x (not batch-1 decode) or a CPU tensor: the GEMM's output through silu_and_mul; a config that is
    not an MMA GEMV cannot be gated."""
    from brrr.kernels.activation import silu_and_mul_ref

    x, q, scales, _ = _w8_problem(2, n=80, k=128, dtype=torch.float32)
    got = qm.w8a16_gated_matmul(x, q, scales)
    assert torch.equal(got, silu_and_mul_ref(*qm.w8a16_matmul(x, q, scales).chunk(2, -1)))
    with pytest.raises(ValueError, match="only the MMA GEMV"):
        qm.w8a16_matmul_triton(x[:1], q, scales, config=qm.w8_configs(1)[0], gated=True)


# ---- the RMSNorms inside the MMA GEMVs (batch-1 decode, brrr/kernels/rms_norm.PendingNorm) -------------------------
def _norm_problem(fmt, n, dtype, device, split=1, kw=False):
    """(run(x, **kw) through one MMA GEMV config, the fp32 reference matmul, x, the config) for int4 g128 or int8,
    K = 512; kw: the first config whose warps split K 4 ways."""
    configs = cfgs.mma_gemv_w8_configs(1, 512) if fmt == "int8" else cfgs.mma_gemv_configs(1, 128)
    cfg = dict(next(c for c in configs if c["KW"] == (4 if kw else 1)), SPLIT_K=split)
    if fmt == "int8":
        x, q, scales, bias = (t.to(device) for t in _w8_problem(1, n=n, k=512, dtype=dtype))
        return (lambda x, **kw: qm.w8a16_matmul_triton(x, q, scales, bias, config=cfg, **kw),  # noqa: E731
                lambda x: qm.w8a16_matmul_ref(x.float(), q, scales, bias.float()), x, cfg)
    x, qweight, scales, zeros, bias, _ = _w4_problem(128, 1, False, n=n, groups=4, dtype=dtype)
    x, qweight, scales, zeros, bias = (t.to(device) for t in (x, qweight, scales, zeros, bias))
    return (lambda x, **kw: qm.w4a16_matmul_triton(x, qweight, scales, zeros, 128, bias, config=cfg, **kw),  # noqa
            lambda x: qm.w4a16_matmul_ref(x.float(), qweight, scales.float(), zeros, 128, bias.float()), x, cfg)


def _pending(h, weight, parts=4, eps=1e-5):
    """h's PendingNorm with its sum of squares cut into `parts` partials, as a GEMV's programs leave it."""
    from brrr.kernels.rms_norm import PendingNorm

    pn = PendingNorm.of(h, weight, eps)
    return PendingNorm(pn.xw, (pn.sq / parts).expand(-1, parts).contiguous(), eps)


@pytest.mark.parametrize("fmt,n,split,kw,dtype", [
    ("int4", 40, 1, False, torch.float32), ("int4", 100, 1, True, torch.float32), ("int8", 64, 3, False, torch.float32),
    ("int8", 130, 1, True, torch.float32), ("int4", 64, 2, False, torch.bfloat16),
    ("int8", 40, 1, True, torch.bfloat16)])
def test_mma_gemv_takes_the_rms_norm_before_it(device, fmt, n, split, kw, dtype):
    """x a PendingNorm (w * h and h's sum of squares in partials): the GEMV of rms_norm(h), its row sums times
    1 / rms(h) (split K, and warps splitting K). It rounds w * h once where rms_norm rounds h / rms
    then the product, so against rms_norm then the GEMV it is close, not equal; against the PendingNorm applied in
    torch then the GEMV, fp32 agrees to the sum's order."""
    from brrr.kernels.rms_norm import rms_norm_ref

    if dtype != torch.float32 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16; the portable paths are covered in fp32")
    run, ref, x, _ = _norm_problem(fmt, n, dtype, device, split=split, kw=kw)
    weight = (1 + 0.3 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1))).to(dtype).to(device)
    h = 8 * x  # rows whose rms is not 1
    pending = _pending(h, weight)
    got = run(pending)
    assert got.shape == (1, n) and got.dtype == dtype
    want = ref(rms_norm_ref(h.float(), weight.float(), 1e-5))
    if dtype == torch.float32:
        torch.testing.assert_close(got, run(pending.apply()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("fmt,n,split,kw,dtype", [
    ("int4", 40, 2, False, torch.float32), ("int8", 100, 1, True, torch.float32), ("int4", 64, 1, True, torch.bfloat16),
    ("int8", 130, 3, False, torch.bfloat16)])
def test_mma_gemv_adds_the_residual_and_writes_the_next_norm_s_inputs(device, fmt, n, split, kw, dtype):
    """residual: h = y + residual, each rounded as the unfused GEMV then `+` (bit for bit: same config), w * h for the
    next norm bit for bit too, and h's sum of squares in a partial a program (their sum: h's, to fp32 order)."""
    from brrr.kernels.rms_norm import PendingNorm

    if dtype != torch.float32 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16; the portable paths are covered in fp32")
    run, _, x, cfg = _norm_problem(fmt, n, dtype, device, split=split, kw=kw)
    g = torch.Generator().manual_seed(2)
    residual = torch.randn(1, n, generator=g).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).to(device)
    h, pending = run(x, residual=residual, next_norm=(weight, 1e-6))
    want = run(x) + residual
    assert torch.equal(h, want) and pending.eps == 1e-6
    expected = PendingNorm.of(want, weight, 1e-6)
    assert torch.equal(pending.xw, expected.xw)
    assert pending.sq.shape == (1, -(-n // cfg["BLOCK_N"]))  # one partial a program
    torch.testing.assert_close(pending.sq.sum(-1, keepdim=True), expected.sq, rtol=1e-5, atol=0)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_gated_mma_gemv_takes_the_rms_norm_too(device, fmt):
    """gate/up of a PendingNorm: the gated GEMV of the applied norm, to fp32 rounding (split K 2; 1 / rms scales the
    sums here, the rows there)."""
    from brrr.kernels.activation import silu_and_mul_ref

    run, ref, x, _ = _norm_problem(fmt, 80, torch.float32, device, split=2)
    weight = (1 + 0.3 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(3))).to(device)
    pending = _pending(3 * x, weight, parts=3)
    got = run(pending, gated=True)
    torch.testing.assert_close(got, silu_and_mul_ref(*run(pending.apply()).chunk(2, -1)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,split,dtype", [("int4", 1, torch.bfloat16), ("int8", 2, torch.float16),
                                             ("int4", 3, torch.float16), ("int8", 1, torch.bfloat16)])
def test_mma_gemv_stores_fp32_logits(device, fmt, split, dtype):
    """out_dtype fp32 (lm_head's logits): the 16-bit outputs widened, bit for bit (split K too), of x and of a
    PendingNorm; the dispatcher's other paths cast after."""
    run, _, x, _ = _norm_problem(fmt, 72, dtype, device, split=split)
    weight = (1 + 0.3 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(4))).to(dtype).to(device)
    for inp in (x, _pending(4 * x, weight)):
        got = run(inp, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, run(inp).float())


def test_norm_and_residual_fall_back_to_torch_around_the_gemm():
    """Two rows (not batch-1 decode) or the CPU reference: rms_norm's stand-in applied in torch, the GEMM, then the
    residual add and the next norm's inputs in torch, with one partial a row."""
    from brrr.kernels.rms_norm import PendingNorm

    x, q, scales, _ = _w8_problem(2, n=64, k=128, dtype=torch.float32)
    weight = torch.rand(128) + 0.5
    pending = PendingNorm.of(x, weight, 1e-5)
    torch.testing.assert_close(qm.w8a16_matmul(pending, q, scales),
                               qm.w8a16_matmul_ref(pending.apply(), q, scales), rtol=0, atol=0)
    residual, nw = torch.randn(2, 64), torch.rand(64)
    h, nxt = qm.w8a16_matmul(x, q, scales, residual=residual, next_norm=(nw, 1e-6))
    assert torch.equal(h, qm.w8a16_matmul_ref(x, q, scales) + residual) and nxt.sq.shape == (2, 1)
    assert torch.equal(nxt.xw, nw * h) and nxt.eps == 1e-6
