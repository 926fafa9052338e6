"""The group-wise (GGUF) kernel's launch configs: the fixed plan, the candidates the tuner times per M bucket
(brrr/kernels/quant/tune.py), and which configs a format and K can run.

A config is a dict: BLOCK_M, BLOCK_N, BLOCK_K (constexprs), DOT (tensor-core tiles, else CUDA-core products),
SPLIT (K slices summed atomically), num_warps, and num_stages for tiles (the GEMVs leave it unset, as the plan did:
Triton pipelines the loads that feed a tl.dot, and brrr's int4/int8 GEMVs never won with stages, configs.py). BLOCK_K
is whole groups, for q4_k whole 64-column pairs of nibbles (`group_step`); K must be a multiple of BLOCK_K x SPLIT.

The candidates for M rows, the first the default (what runs untuned: fp32, the interpreter, a shape warm-up never
met) and always the plan, so a tuned pick is never one the timer ranked below today's plan:
  M <= GEMV_M  the GEMVs: BLOCK_N x warps (`GEMV_SHAPES`), BLOCK_K the largest step <= the plan's that keeps a
               thread's products within GEMV_THREAD_PRODUCTS, SPLIT reaching `SPLIT_TARGETS` programs per SM;
               and the 16-row tiles with and without split K
  above        the tiles `TILES` whose BLOCK_M fits the bucket, BLOCK_K 64 / 128 (and the plan's), 2 stage counts;
               split K for the narrow ones up to MID_M rows
The tuner times them as a coordinate search (`groupwise_family`): the first config of each tile shape (the plan's
K step, stages and split), then the fastest shape's other variations. The full list took past 230 s of warm-up for
a Q4_K_M 8B engine (about 60 compiles and timings a shape at each decode M); the search takes about a third.
"""
from __future__ import annotations

from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.quant.configs import LIMITS
from brrr.kernels.quant.tune import bucket

GROUPWISE_GROUPS = {"q8_0": 32, "q6_k": 16, "q5_k": 32, "q4_k": 32}
SUPER = 256  # the K-quants' super-block
GEMV_M = LIMITS.gemv_m  # rows of x up to which the CUDA-core GEMV runs (each M its own tuning bucket)
MID_M = LIMITS.mid_m  # rows up to which narrow tiles also take split K
MAX_SPLIT = 16
GEMV_SHAPES = ((16, 2), (16, 4), (16, 8), (32, 2), (32, 4), (32, 8), (64, 2), (64, 4), (64, 8), (128, 2), (128, 4),
               (128, 8))  # (BLOCK_N, num_warps)
GEMV_THREAD_PRODUCTS = 128  # fp32 products x * w a thread holds per K step (BLOCK_M x BLOCK_N x BLOCK_K / threads)
SPLIT_TARGETS = (1, 2, 4, 8)  # programs per SM a GEMV's split K aims at (the plan: 4)
# (BLOCK_M, BLOCK_N, num_warps): 8 warps only from 64 x 64 outputs, 4 only up to 64 x 128
TILES = ((16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 64, 8),
         (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8))
TILE_BLOCK_K = (64, 128)
DEFAULT_STAGES = 3  # Triton's num_stages on CUDA: the plan's tiles, which left it unset before tuning


def group_step(fmt: str) -> int:
    """Columns BLOCK_K must be a multiple of: a group, or q4_k's 64-column pair of nibble halves."""
    return 64 if fmt == "q4_k" else GROUPWISE_GROUPS[fmt]


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def config_error(cfg: dict, fmt: str, k: int) -> str | None:
    """Why `cfg` cannot run format `fmt` with K columns, or None when it can."""
    step, bk, split = group_step(fmt), cfg["BLOCK_K"], cfg["SPLIT"]
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if not _pow2(cfg[name]):
            return f"{name} = {cfg[name]} is not a power of two (tl.arange)"
    if bk < step:
        return f"BLOCK_K = {bk} is less than {fmt}'s group step {step}"
    if not (isinstance(split, int) and 1 <= split <= MAX_SPLIT):
        return f"SPLIT = {split} is not an integer in 1..{MAX_SPLIT}"
    if k % (bk * split):
        return f"K = {k} is not a multiple of BLOCK_K x SPLIT = {bk * split}"
    dot_k = bk // 2 if fmt == "q4_k" else bk  # q4_k's dots take one nibble half of the step
    if cfg["DOT"] and min(cfg["BLOCK_M"], cfg["BLOCK_N"], dot_k) < 16:
        return f"tl.dot needs 16 or more rows, columns and K: {cfg['BLOCK_M']} x {cfg['BLOCK_N']} x {dot_k}"
    return None


def _split(programs: int, steps: int, target: int) -> int:
    """K slices (a power of two dividing the BLOCK_K steps, at most MAX_SPLIT) doubled until `programs` x slices
    reach `target` programs."""
    split = 1
    while split < MAX_SPLIT and steps % (2 * split) == 0 and programs * split < target:
        split *= 2
    return split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _largest_block_k(fmt: str, k: int) -> int:
    """256 (a super-block) where K allows, else the largest whole number of group steps dividing K."""
    step = group_step(fmt)
    return next(b for b in (256, 128, 64, 32, 16) if b % step == 0 and k % b == 0)


def _tile_block_k(fmt: str, k: int) -> int:
    """The plan's tile BLOCK_K: 128 for q4_k, 64 for the int8-code formats, where K allows."""
    block_k = _largest_block_k(fmt, k)
    return min(block_k, 128 if fmt == "q4_k" else 64) if k % 64 == 0 else block_k


def groupwise_config(m: int, n: int, k: int, fmt: str, sms: int = 132) -> dict:
    """The fixed plan for M rows: the GEMV (CUDA cores, K split until the programs fill the SMs about 4 times)
    for M <= GEMV_M, else tensor-core tiles. BLOCK_K: 256 (a super-block) where K allows, else the largest whole
    number of groups that divides K."""
    block_k = _largest_block_k(fmt, k)
    if m <= GEMV_M:
        block_n = 16
        return dict(BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, DOT=False,
                    SPLIT=_split(_cdiv(n, block_n), k // block_k, 4 * sms), num_warps=4)
    return dict(BLOCK_M=64 if m >= 64 else 16, BLOCK_N=64, BLOCK_K=_tile_block_k(fmt, k), DOT=True, SPLIT=1,
                num_warps=4, num_stages=DEFAULT_STAGES)


def _gemvs(m: int, n: int, k: int, fmt: str, sms: int) -> list[dict]:
    block_m, step, top = next_power_of_2(m), group_step(fmt), _largest_block_k(fmt, k)
    out = []
    for block_n, warps in GEMV_SHAPES:
        fits = [b for b in (256, 128, 64, 32, 16) if step <= b <= top and k % b == 0
                and block_m * block_n * b <= GEMV_THREAD_PRODUCTS * 32 * warps]
        if not fits:
            continue
        block_k = fits[0]
        programs, steps = _cdiv(n, block_n), k // block_k
        # the plan's split (4 programs an SM) first: the family's representative in the coordinate search
        for split in dict.fromkeys([_split(programs, steps, 4 * sms), 1] +
                                   [_split(programs, steps, t * sms) for t in SPLIT_TARGETS]):
            out.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=False, SPLIT=split,
                            num_warps=warps))
    return out


def _tiles(rows: int, n: int, k: int, fmt: str, sms: int, block_ms: tuple[int, int], split: bool) -> list[dict]:
    """The `TILES` with block_ms[0] <= BLOCK_M <= block_ms[1]; with `split`, those of BLOCK_M <= 32 also split K
    for about 4 programs an SM (as the GEMV plan does)."""
    step = group_step(fmt)
    plan_k = _tile_block_k(fmt, k)  # each family's first config: the plan's K step, stages and split
    block_ks = [plan_k] + sorted({b for b in TILE_BLOCK_K if b % step == 0 and k % b == 0} - {plan_k})
    out = []
    for block_m, block_n, warps in TILES:
        if not block_ms[0] <= block_m <= block_ms[1]:
            continue
        for block_k in block_ks:
            splits = [1]
            if split and block_m <= 32:
                splits = list(dict.fromkeys([_split(_cdiv(rows, block_m) * _cdiv(n, block_n), k // block_k,
                                                    4 * sms), 1]))
            for stages in (3, 2) if block_m >= 128 else (3, 4):
                out += [dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=True, SPLIT=s,
                             num_warps=warps, num_stages=stages) for s in splits]
    return out


def groupwise_family(cfg: dict) -> tuple:
    """What the tuner's coordinate search varies first (tune.py): the tile or GEMV shape and its warps; a family's
    K step, stages and split are timed only for the fastest family (about 20 timings a shape instead of 60)."""
    return cfg["DOT"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]


def groupwise_candidates(m: int, n: int, k: int, fmt: str, sms: int = 132) -> list[dict]:
    """The configs the tuner times for M rows (module docstring): the plan first, then the rest of M's bucket's
    list (built for the bucket's largest M, so every M of a bucket shares it), each valid for fmt and K."""
    b = bucket(m)
    if m <= GEMV_M:
        rest = _gemvs(m, n, k, fmt, sms) + _tiles(b, n, k, fmt, sms, (16, 16), split=True)
    else:
        rest = _tiles(b, n, k, fmt, sms, (min(64, max(16, b // 8)), min(128, b)), split=b <= MID_M)
    plan = groupwise_config(m, n, k, fmt, sms)
    return [plan] + [c for c in rest if c != plan and config_error(c, fmt, k) is None]
