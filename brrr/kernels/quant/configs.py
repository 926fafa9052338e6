"""The quantized matmuls' candidate configs and the row-count limits between their paths.

Each family's table is a tuple of named, frozen configs; `w4_configs` / `w8_configs` turn the ones that fit M into
the launch form (a dict of the kernel's constexprs plus num_warps, num_stages, SPLIT_K), in a fixed order whose
first entry is the default: what runs when nothing was tuned (the interpreter, fp32, a shape warm-up never met).
The tuner (brrr/kernels/quant/tune.py) times them per shape at warm-up.

SPLIT_K is a number of K slices, or "auto", "auto2", "auto4", "auto8": enough slices for about 2, 2, 4, 8 programs
per SM (brrr/kernels/quant/launch.split_k).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from brrr.kernels.dispatch import next_power_of_2

SplitK = int | str


@dataclass(frozen=True)
class Limits:
    """Rows of x at which the paths change: the GEMVs up to gemv_m (each M its own tuning bucket), the 16-row
    decode tiles up to small_m, the narrow split-K tiles up to mid_m, the tiled GEMM and dequantize-then-F.linear
    above; tuning buckets stop growing at max_bucket rows."""
    gemv_m: int = 4
    small_m: int = 16
    mid_m: int = 128
    max_bucket: int = 8192


@dataclass(frozen=True)
class Tile:
    """A tensor-core tile: block_m x block_n outputs, block_k input columns an iteration (int4: whole groups; the
    int8 tiled and mid-M tiles read half as many bytes' columns)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: SplitK
    warps: int
    stages: int


@dataclass(frozen=True)
class MmaDecode:
    """The int4 MMA decode kernel (M <= small_m): block_n rows of W (a multiple of 16 x warps, `_mma_rows`), two
    groups an iteration (pair), the L2 prefetch distance in groups (0: none), the next group's x, zeros and scales
    loaded a group ahead (ahead)."""
    block_n: int
    warps: int
    split_k: SplitK
    pair: bool
    prefetch: int
    ahead: bool


@dataclass(frozen=True)
class Gemv:
    """The CUDA-core GEMVs (M <= gemv_m): block_n rows of W, 16-byte chunks per row per step, L2 prefetch distance
    in loop steps (0: none). Rows of W per thread R = block_n * chunks / (32 * warps): a thread's x loads and
    conversions are shared by its R rows, at the cost of R * M accumulators."""
    block_n: int
    chunks: int
    split_k: SplitK
    warps: int
    prefetch: int


@dataclass(frozen=True)
class MmaGemv:
    """The MMA GEMVs (M = 1): block_n rows of W a program (block_n / 2 x kw a multiple of 8 x warps, and kw divides
    warps: a warp's rows share a K slice), the next group's loads issued before this one computes (ahead; 2: two
    steps in flight, int8 only), kw warps splitting a program's K range (their slices summed in shared memory,
    not across programs), maxnreg: a register cap a thread."""
    block_n: int
    warps: int
    split_k: SplitK
    ahead: bool | int
    kw: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class Candidates:
    """Every family's configs. The first small-M tile is the decode default. The swapped int4 tiles (y^T = W x^T)
    come after each M range's candidates, those whose block_m fits it (`swap_configs`). The GEMVs never pipeline
    the K loop through shared memory (Triton's stages): it never gave a shape's fastest candidate. The MMA GEMV
    candidates leave out what never won for int4: two groups ahead, two groups an iteration, shared-memory
    pipelining, TMA loads; the int8 ones add 256-row tiles (int8 holds fewer registers a row) and two steps in
    flight under a register cap."""
    small: tuple[Tile, ...] = (
        Tile(16, 64, 256, "auto4", 4, 4), Tile(16, 128, 256, "auto", 4, 3), Tile(16, 64, 256, "auto", 4, 4),
        Tile(16, 128, 256, "auto", 8, 3), Tile(16, 128, 512, "auto", 4, 2), Tile(16, 64, 512, "auto", 4, 3),
        Tile(16, 32, 256, "auto", 4, 4), Tile(16, 128, 256, "auto4", 4, 3), Tile(16, 32, 256, "auto4", 4, 4),
        Tile(16, 64, 256, "auto8", 4, 4), Tile(16, 64, 512, "auto4", 4, 3), Tile(16, 128, 256, 1, 4, 3))
    tiled: tuple[Tile, ...] = (
        Tile(128, 128, 128, 1, 8, 3), Tile(128, 256, 128, 1, 8, 2), Tile(64, 256, 128, 1, 4, 3),
        Tile(64, 128, 128, 1, 4, 4))
    # small_m < M <= mid_m (batched decode): narrow strips with split K, as at small M; the tiled configs give too
    # few programs there
    mid: tuple[Tile, ...] = (
        Tile(32, 64, 256, "auto4", 4, 3), Tile(64, 64, 128, "auto4", 4, 3), Tile(32, 128, 256, "auto", 4, 3),
        Tile(64, 128, 128, "auto", 4, 3))
    swapped: tuple[Tile, ...] = (
        Tile(16, 64, 128, "auto4", 4, 4), Tile(16, 128, 128, "auto4", 8, 3), Tile(32, 64, 128, "auto4", 4, 4),
        Tile(64, 64, 128, "auto4", 4, 3), Tile(64, 128, 128, "auto4", 8, 3), Tile(128, 128, 128, "auto", 8, 3),
        Tile(128, 128, 128, 1, 8, 3), Tile(256, 128, 128, 1, 8, 3), Tile(128, 256, 128, 1, 8, 3))
    mma_decode: tuple[MmaDecode, ...] = (
        MmaDecode(64, 4, "auto4", False, 4, False), MmaDecode(64, 4, "auto8", True, 4, False),
        MmaDecode(64, 4, "auto4", False, 8, False), MmaDecode(128, 8, "auto4", False, 4, False),
        MmaDecode(64, 4, "auto4", False, 0, False), MmaDecode(128, 8, "auto8", True, 2, False),
        MmaDecode(64, 4, "auto4", False, 4, True))
    gemv: tuple[Gemv, ...] = (
        Gemv(256, 4, "auto4", 4, 0), Gemv(128, 4, "auto4", 4, 0), Gemv(256, 2, "auto4", 2, 0),
        Gemv(128, 2, "auto8", 2, 0), Gemv(128, 4, "auto8", 2, 0), Gemv(64, 4, "auto8", 2, 0),
        Gemv(512, 4, "auto", 8, 0), Gemv(256, 4, "auto4", 4, 4), Gemv(128, 4, "auto8", 2, 4),
        Gemv(128, 4, "auto8", 2, 8))
    mma_gemv: tuple[MmaGemv, ...] = (
        MmaGemv(128, 8, "auto4", False, 1), MmaGemv(64, 4, "auto8", False, 1), MmaGemv(128, 8, "auto4", True, 1),
        MmaGemv(64, 4, "auto8", True, 1), MmaGemv(128, 8, "auto8", False, 1), MmaGemv(128, 8, "auto2", True, 1),
        MmaGemv(16, 8, 1, False, 8), MmaGemv(16, 8, 1, True, 8), MmaGemv(16, 16, 1, True, 16),
        MmaGemv(32, 8, 1, True, 4), MmaGemv(32, 16, 1, False, 8), MmaGemv(16, 8, "auto4", True, 8),
        MmaGemv(16, 4, 1, True, 4))
    mma_gemv_w8_extra: tuple[MmaGemv, ...] = (MmaGemv(256, 8, "auto4", False, 1), MmaGemv(16, 4, 1, 2, 4, 72))

    @property
    def mma_gemv_w8(self) -> tuple[MmaGemv, ...]:
        return self.mma_gemv + self.mma_gemv_w8_extra


LIMITS = Limits()
CANDIDATES = Candidates()
DEQUANT = MappingProxyType({"DEQUANT": True})  # for M > small_m: dequantize the weight once, then F.linear (cuBLAS)


def _mma_gemv_dicts(table) -> list[dict]:
    """The table's configs releasing the next kernel from their epilogue, then those with kw = 1 from their last K
    step (`LAST_STEP_RELEASE`; the tuner picks per shape). A kw > 1 warp has only a few steps, so its last one
    comes early: in the decode step such configs lost."""
    return [dict(MMA_GEMV=True, BLOCK_M=1, BLOCK_N=c.block_n, AHEAD=c.ahead, SPLIT_K=c.split_k, KW=c.kw,
                 LAST_STEP_RELEASE=last, num_warps=c.warps, num_stages=1,
                 **({} if c.maxnreg is None else {"maxnreg": c.maxnreg}))
            for last in (False, True) for c in table if not (last and c.kw > 1)]


def mma_gemv_configs(m: int, group_size: int) -> list[dict]:
    """The int4 MMA GEMV's candidates: M = 1 and group 128 only (the MMA's K relabeling needs a 16-word group)."""
    return _mma_gemv_dicts(CANDIDATES.mma_gemv) if m == 1 and group_size == 128 else []


def mma_gemv_w8_configs(m: int, k: int) -> list[dict]:
    """The int8 MMA GEMV's candidates: M = 1 and K a multiple of 64."""
    return _mma_gemv_dicts(CANDIDATES.mma_gemv_w8) if m == 1 and k % 64 == 0 else []


def gemv_configs(m: int) -> list[dict]:
    """The CUDA-core GEMVs' candidates for M <= gemv_m rows, those whose R * M accumulators fit a thread."""
    if m > LIMITS.gemv_m:
        return []
    max_rows = 16 if m == 1 else 8 if m == 2 else 4
    return [dict(BLOCK_M=next_power_of_2(m), ROWS=m, BLOCK_N=c.block_n, CHUNKS=c.chunks, SPLIT_K=c.split_k,
                 PREFETCH=c.prefetch, STAGES=1, num_warps=c.warps, num_stages=1)
            for c in CANDIDATES.gemv if c.block_n * c.chunks // (32 * c.warps) <= max_rows]


def swap_configs(m: int, group_size: int) -> list[dict]:
    """The swapped int4 tiles for M rows: none up to gemv_m (the GEMVs own those), block_m 16 up to small_m,
    32-128 (at most M rounded up) up to mid_m, 128 and up above."""
    lim = LIMITS
    if m <= lim.gemv_m:
        return []
    lo, hi = (16, 16) if m <= lim.small_m else (32, next_power_of_2(m)) if m <= lim.mid_m else (128, 256)
    return [dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUPS_PER_ITER=max(1, c.block_k // group_size),
                 SPLIT_K=c.split_k, SWIZZLE=8 if m > lim.mid_m else 1, SWAP=True, num_warps=c.warps,
                 num_stages=c.stages)
            for c in CANDIDATES.swapped if lo <= c.block_m <= hi]


def _tiles(table, block_k, swizzle: int) -> list[dict]:
    return [dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, **block_k(c.block_k), SPLIT_K=c.split_k, SWIZZLE=swizzle,
                 num_warps=c.warps, num_stages=c.stages) for c in table]


def w4_configs(m: int, group_size: int, gemv: bool = True) -> list[dict]:
    """Candidates for the int4 kernels, the first the default. For M <= small_m: the 16-row tensor-core tiles, the
    MMA decode ones (an `MMA` key), the swapped tiles (`SWAP`), then (gemv: the weight reads as int32 words) the
    GEMVs (a `CHUNKS` key) and the MMA GEMVs (`MMA_GEMV`). Above: the tiled ones, the mid-M ones up to mid_m,
    dequantize-then-F.linear, the swapped tiles."""
    per = lambda bk: {"GROUPS_PER_ITER": max(1, bk // group_size)}  # noqa: E731  (whole groups per iteration)
    if m <= LIMITS.small_m:
        return (_tiles(CANDIDATES.small, per, 1)
                + [dict(MMA=True, BLOCK_M=16, BLOCK_N=c.block_n, NW=c.warps, PAIR=c.pair, PREFETCH=c.prefetch,
                        AHEAD=c.ahead, SPLIT_K=c.split_k, num_warps=c.warps, num_stages=1)
                   for c in CANDIDATES.mma_decode]
                + swap_configs(m, group_size) + (gemv_configs(m) + mma_gemv_configs(m, group_size) if gemv else []))
    mid = _tiles(CANDIDATES.mid, per, 1) if m <= LIMITS.mid_m else []
    return _tiles(CANDIDATES.tiled, per, 8) + mid + [dict(DEQUANT)] + swap_configs(m, group_size)


def w8_configs(m: int, gemv: bool = True, k: int | None = None, cuda_core: bool = True) -> list[dict]:
    """Candidates for the int8 kernels, the first the default; GEMV ones (M <= gemv_m; cuda_core False: none, FP8)
    and MMA GEMV ones (M = 1, K a multiple of 64; k None: as if it were) last, when the weight can be read as int32
    words (`gemv`)."""
    if m <= LIMITS.small_m:
        gemvs = ((gemv_configs(m) if cuda_core else []) + mma_gemv_w8_configs(m, 64 if k is None else k)
                 if gemv else [])
        return _tiles(CANDIDATES.small, lambda bk: {"BLOCK_K": bk}, 1) + gemvs
    half = lambda bk: {"BLOCK_K": bk // 2}  # noqa: E731
    mid = _tiles(CANDIDATES.mid, half, 1) if m <= LIMITS.mid_m else []
    return _tiles(CANDIDATES.tiled, half, 8) + mid + [dict(DEQUANT)]
