"""The quantized matmuls' entry points: y = x @ W^T (+ bias) with int4 group-wise (W4A16) or int8 / E4M3
per-channel (W8A16) weights, each call running the config tuned for its shape (brrr/kernels/quant/tune.py) on one
of the kernel families: tensor-core tiles and MMA decode (gemm.py), CUDA-core GEMVs (gemv.py), MMA GEMVs with
the gate/up, norm and residual epilogues (mma_gemv.py), or dequantize-then-F.linear (dequant.py)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from brrr.kernels.activation import silu_and_mul
from brrr.kernels.dispatch import next_power_of_2, use_triton
from brrr.kernels.quant.configs import mma_gemv_configs, mma_gemv_w8_configs, w4_configs, w8_configs
from brrr.kernels.quant.dequant import dequantize_w4_triton, dequantize_w8_codes
from brrr.kernels.quant.launch import INTERPRETED, fast_dequant, launch, rows
from brrr.kernels.quant.layouts import INT4_GROUPS, int32_words, packed_strides, w4a16_matmul_ref, w8a16_matmul_ref
from brrr.kernels.quant.tune import TUNED_CONFIGS
from brrr.kernels.rms_norm import PendingNorm

try:
    import triton
except Exception:  # the dispatcher takes the reference when triton is missing
    triton = None

if triton is not None:
    from brrr.kernels.quant.gemm import _w4a16_kernel, _w4a16_mma_kernel, _w8a16_kernel
    from brrr.kernels.quant.gemv import _w4a16_gemv_kernel, _w8a16_gemv_kernel
    from brrr.kernels.quant.mma_gemv import _w4a16_mma_gemv_kernel, _w8a16_mma_gemv_kernel


def with_norm_and_residual(matmul, x, residual: torch.Tensor | None = None, next_norm: tuple | None = None):
    """The unfused form of the MMA GEMV's NORM and RESIDUAL: matmul of x, or of the rows a PendingNorm x stands for;
    with a residual, (h = y + residual, PendingNorm.of(h, *next_norm))."""
    y = matmul(x.apply() if isinstance(x, PendingNorm) else x)
    if residual is None:
        return y
    h = y + residual
    return h, PendingNorm.of(h, *next_norm)


MAX_NORM_PARTS = 4096  # a PendingNorm's sums of squares are read whole by every program (`_norm_sums`)
MAX_FUSED_REGS = 64  # registers a thread for MMA GEMVs taking a norm or a residual (`_fused_args`)


def _fusable(x2, norm: PendingNorm | None, residual: torch.Tensor | None, next_norm: tuple | None) -> bool:
    """The MMA GEMV takes the norm and the residual add: one row, 16-bit or fp32, a contiguous residual in x's
    dtype and norm weight."""
    return (x2.shape[0] == 1 and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (norm is None or (norm.sq.is_contiguous() and norm.sq.numel() <= MAX_NORM_PARTS))
            and (residual is None or (residual.dtype == x2.dtype and residual.is_contiguous()
                                      and next_norm[0].is_contiguous())))


def _fused_args(x2, n: int, cfg: dict, norm: PendingNorm | None = None, residual: torch.Tensor | None = None,
                next_norm: tuple | None = None):
    """(kernel arguments R, SQ, NW, XN, SQ_IN, n_sq, eps; their constexprs; the PendingNorm RESIDUAL writes or None)
    for `_fusable` calls."""
    pending = None
    if residual is not None:
        sq = torch.empty(1, triton.cdiv(n, cfg["BLOCK_N"]), dtype=torch.float32, device=x2.device)
        pending = PendingNorm(torch.empty(1, n, dtype=x2.dtype, device=x2.device), sq, next_norm[1])
    args = (None, None, None, None) if residual is None else (residual, pending.sq, next_norm[0], pending.xw)
    args += (None, 0, 0.0) if norm is None else (norm.sq, norm.sq.numel(), norm.eps)
    consts = dict(NORM=norm is not None, RESIDUAL=residual is not None,
                  BLOCK_SQ=1 if norm is None else next_power_of_2(norm.sq.numel()))
    if (norm is not None or residual is not None) and "maxnreg" not in cfg:
        # the plain configs compile to <= 64 registers a thread (sm_90); the residual and the next norm's weight,
        # held through the K loop, took a 16-warp one to 76 and its programs from 2 an SM to 1
        consts["maxnreg"] = MAX_FUSED_REGS
    return args, consts, pending


def _gemv(cfg: dict) -> bool:
    return "CHUNKS" in cfg


def _gemv_chunks(cfg: dict, group_size: int) -> dict:
    """An int4 GEMV step never spans groups: at most group_size / 32 chunks."""
    return dict(cfg, CHUNKS=min(cfg["CHUNKS"], group_size // 32))


def w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias=None, config: dict | None = None,
                        gated: bool = False, release_early: bool = False, residual: torch.Tensor | None = None,
                        next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    """x [..., K] -> [..., N]. `config` forces one (tests); else the tuned one. gated (M = 1, group 128; N = 2 x I
    rows, gate then up): silu(x @ W_gate^T) * (x @ W_up^T) [..., I] from the MMA GEMV's epilogue. release_early:
    an MMA GEMV config releases the next kernel at its last K step (`_hinted`). x a PendingNorm: of the
    rows it stands for. residual (next_norm: the next RMSNorm's (weight, eps)): (h = y + residual, the PendingNorm
    of h). Those two in the MMA GEMV at M = 1 (the tuner picks among its configs), else `with_norm_and_residual`.
    out_dtype (fp32 logits): the MMA GEMV stores y rounded to x's dtype, widened; the other kernels give x's dtype."""
    norm, x = (x, x.xw) if isinstance(x, PendingNorm) else (None, x)
    k, n = x.shape[-1], qweight.shape[0]
    x2 = rows(x)
    m = x2.shape[0]
    fuse = norm is not None or residual is not None
    if fuse and not (group_size == 128 and int32_words(qweight) is not None
                     and _fusable(x2, norm, residual, next_norm)):
        run = functools.partial(w4a16_matmul_triton, qweight=qweight, scales=scales, zeros=zeros,
                                group_size=group_size, bias=bias, config=config, gated=gated,
                                release_early=release_early)
        return with_norm_and_residual(run, x if norm is None else norm, residual, next_norm)
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    fast = fast_dequant(x.dtype)
    consts = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, FAST=fast,
                  IEEE=x.dtype == torch.float32 or INTERPRETED)
    words = int32_words(qweight)

    def run(cfg, qweight=qweight, fused=True):  # qweight: a copy of the weight when the tuner times a chain
        words = int32_words(qweight)
        chunk_stride = packed_strides(qweight)[1]
        word_chunk_stride = None if words is None else packed_strides(words)[1]
        # unused pointer arguments get a real tensor (scales) so every launch has the same signature
        args = (x2, qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias)
        if (gated or fused and fuse) and not cfg.get("MMA_GEMV"):  # a config given (tests) that cannot take them
            raise ValueError("only the MMA GEMV takes gated, a PendingNorm or a residual")
        if cfg.get("DEQUANT"):
            return F.linear(x2, dequantize_w4_triton(qweight, scales, zeros, group_size, x.dtype), bias)
        if cfg.get("MMA"):
            return launch(_w4a16_mma_kernel, x2, n, k // group_size, x.dtype,
                          {key: v for key, v in cfg.items() if key != "MMA"}, args, consts, extra=(chunk_stride,))
        if (cfg.get("MMA_GEMV") or _gemv(cfg)) and words is None:
            raise ValueError("the GEMV kernel reads qweight as int32 words: rows must be 4-byte aligned")
        if cfg.get("MMA_GEMV"):
            # no FMA contraction (the MMAs are inline PTX anyway): the epilogue rounds the scaled sum before the
            # bias, gated or not, so the gated GEMV is the plain one then silu_and_mul bit for bit
            xa = x2 if x2.data_ptr() % 8 == 0 else x2.clone()  # x is read 8 bytes at a time
            fused_args, fused_consts, pending = _fused_args(xa, n, cfg, *(norm, residual, next_norm) if fused else ())
            y = launch(_w4a16_mma_gemv_kernel, xa, n, k // group_size, (fused and out_dtype) or x.dtype,
                       {key: v for key, v in cfg.items() if key != "MMA_GEMV"}, (xa, words, *args[2:]),
                       dict(HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, FAST=fast, GATED=gated,
                            enable_fp_fusion=False, **fused_consts),
                       extra=(scales.stride(1), word_chunk_stride, *fused_args))
            return y if pending is None else (y, pending)
        if _gemv(cfg):
            gemv_consts = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
                               FAST=not INTERPRETED, EVEN_N=n % cfg["BLOCK_N"] == 0)
            return launch(_w4a16_gemv_kernel, x2, n, k // group_size, x.dtype, _gemv_chunks(cfg, group_size),
                          (x2, words, *args[2:]), gemv_consts, extra=(scales.stride(1), word_chunk_stride))
        return launch(_w4a16_kernel, x2, n, k // group_size, x.dtype, cfg, args, consts, extra=(chunk_stride,))

    if config is None:  # fp32 (tests, CPU-made models on a GPU) runs the default config: no tuning cost
        shape = ("w4", n, k, group_size, x.dtype, zeros is not None, bias is not None, gated)
        candidates = lambda: (mma_gemv_configs(m, group_size) if gated  # noqa: E731
                              else w4_configs(m, group_size, gemv=words is not None))
        config = _tuned(x2.device, shape, m, candidates, run, qweight, x.dtype, fuse,
                        lambda: mma_gemv_configs(m, group_size))
    return _shaped(run(_hinted(config, release_early)), x, n // 2 if gated else n)


def _tuned(device, shape: tuple, m: int, candidates, run, qweight, dtype, fuse: bool, mma_gemvs) -> dict:
    """The config for M rows of `shape`: the default for fp32 (tests, CPU-made models on a GPU: no tuning cost),
    else `TUNED_CONFIGS`'. A call with the norm or the residual in the GEMV (fuse) runs the plain shape's config,
    tuned without them (they change a few loads and the epilogue, not the loop; tuned apart, near-equal candidates
    swapped ranks by noise), when it is an MMA GEMV; else the fastest MMA GEMV."""
    if dtype == torch.float32:
        configs = mma_gemvs() if fuse else candidates()
        return configs[0]
    config = TUNED_CONFIGS.config(device, shape, m, candidates, lambda cfg, w=qweight: run(cfg, w, fused=False),
                                  qweight)
    if fuse and not config.get("MMA_GEMV"):
        config = TUNED_CONFIGS.config(device, shape + ("fused",), m, mma_gemvs, run, qweight)
    return config


def _shaped(out, x, n: int):
    """y as [..., n] (x's leading dims); with a residual, (h, its PendingNorm)."""
    if isinstance(out, tuple):
        return out[0].view(*x.shape[:-1], n), out[1]
    return out.view(*x.shape[:-1], n)


def _hinted(cfg: dict, release_early: bool) -> dict:
    """cfg, releasing the next launch at its last K step when the caller asks (release_early) and it is an MMA
    GEMV: the packed q/k/v projection, whose next kernel, decode attention, reads its first keys before its wait."""
    if release_early and cfg.get("MMA_GEMV") and not cfg.get("LAST_STEP_RELEASE"):
        return {**cfg, "LAST_STEP_RELEASE": True}
    return cfg


def w8a16_matmul_triton(x, qweight, scales, bias=None, config: dict | None = None, gated: bool = False,
                        release_early: bool = False, residual: torch.Tensor | None = None,
                        next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    """As `w4a16_matmul_triton`; gated, a PendingNorm x, residual: M = 1, K a multiple of 64. A float8_e4m3fn
    qweight (weight-only FP8) runs the same kernels on its bytes, converting E4M3 instead of int8 (no CUDA-core
    GEMV candidates)."""
    norm, x = (x, x.xw) if isinstance(x, PendingNorm) else (None, x)
    k, n = x.shape[-1], qweight.shape[0]
    x2 = rows(x)
    m = x2.shape[0]
    fuse = norm is not None or residual is not None
    if fuse and not (k % 64 == 0 and int32_words(qweight) is not None and _fusable(x2, norm, residual, next_norm)):
        run = functools.partial(w8a16_matmul_triton, qweight=qweight, scales=scales, bias=bias, config=config,
                                gated=gated, release_early=release_early)
        return with_norm_and_residual(run, x if norm is None else norm, residual, next_norm)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    qweight = qweight.view(torch.int8) if fp8 else qweight
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    fast = fast_dequant(x.dtype)
    consts = dict(HAS_BIAS=bias is not None, FAST=fast, IEEE=x.dtype == torch.float32 or INTERPRETED, FP8=fp8)
    words = int32_words(qweight)

    def run(cfg, qweight=qweight, fused=True):  # qweight: a copy of the weight when the tuner times a chain
        words = int32_words(qweight)
        chunk_stride = packed_strides(qweight)[1]
        args = (x2, qweight, scales, scales if bias is None else bias)
        if (gated or fused and fuse) and not cfg.get("MMA_GEMV"):  # a config given (tests) that cannot take them
            raise ValueError("only the MMA GEMV takes gated, a PendingNorm or a residual")
        if cfg.get("DEQUANT"):
            return F.linear(x2, dequantize_w8_codes(qweight, scales, x.dtype, fp8), bias)
        if (cfg.get("MMA_GEMV") or _gemv(cfg)) and words is None:
            raise ValueError("the GEMV kernel reads qweight as int32 words: K must be a multiple of 4")
        if cfg.get("MMA_GEMV"):
            if k % 64:
                raise ValueError(f"the int8 MMA GEMV reads K in steps of 64 columns; K = {k}")
            xa = x2 if x2.data_ptr() % 8 == 0 else x2.clone()  # x is read 8 bytes at a time (fp fusion: as int4)
            fused_args, fused_consts, pending = _fused_args(xa, n, cfg, *(norm, residual, next_norm) if fused else ())
            y = launch(_w8a16_mma_gemv_kernel, xa, n, k // 64, (fused and out_dtype) or x.dtype,
                       {key: v for key, v in cfg.items() if key != "MMA_GEMV"}, (xa, words, *args[2:]),
                       dict(HAS_BIAS=bias is not None, FAST=fast, GATED=gated, FP8=fp8, enable_fp_fusion=False,
                            **fused_consts),
                       extra=(packed_strides(words)[1], *fused_args))
            return y if pending is None else (y, pending)
        if _gemv(cfg):
            if fp8:
                raise ValueError("the CUDA-core GEMV reads int8 codes only; FP8 weights take the other kernels")
            gemv_consts = dict(HAS_BIAS=bias is not None, FAST=not INTERPRETED,
                               EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % (16 * cfg["CHUNKS"]) == 0)
            return launch(_w8a16_gemv_kernel, x2, n, triton.cdiv(k, 16 * cfg["CHUNKS"]), x.dtype, cfg,
                          (x2, words, *args[2:]), gemv_consts, extra=(packed_strides(words)[1],))
        return launch(_w8a16_kernel, x2, n, triton.cdiv(k, cfg["BLOCK_K"]), x.dtype, cfg, args, consts,
                      extra=(chunk_stride,))

    if config is None:
        candidates = lambda: (mma_gemv_w8_configs(m, k) if gated  # noqa: E731
                              else w8_configs(m, gemv=words is not None, k=k, cuda_core=not fp8))
        shape = ("w8", n, k, x.dtype, bias is not None, gated, fp8)
        config = _tuned(x2.device, shape, m, candidates, run, qweight, x.dtype, fuse,
                        lambda: mma_gemv_w8_configs(m, k))
    return _shaped(run(_hinted(config, release_early)), x, n // 2 if gated else n)


# ---- dispatchers: Triton on CUDA, the reference elsewhere ------------------------------------------------------------
def _dtype_ok(x) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def w4a16_matmul(x, qweight, scales, zeros, group_size, bias=None, release_early: bool = False,
                 residual: torch.Tensor | None = None, next_norm: tuple | None = None,
                 out_dtype: torch.dtype | None = None):
    """x @ W^T (+ bias), W int4 group-wise in the kernel layout. Triton on CUDA, the reference elsewhere. x may be
    a PendingNorm, and a residual with the next norm's (weight, eps) gives (h, its PendingNorm): as
    `w4a16_matmul_triton`. out_dtype (no residual): y in that dtype, its values those of x's dtype (fp32 logits)."""
    x1 = PendingNorm.rows(x)
    tensors = [x1, qweight, scales] + [t for t in (zeros, bias) if t is not None]
    if group_size in INT4_GROUPS and x1.shape[-1] % group_size == 0 and _dtype_ok(x1) and use_triton(*tensors):
        y = w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias, release_early=release_early,
                                residual=residual, next_norm=next_norm, out_dtype=out_dtype)
    else:
        y = with_norm_and_residual(lambda x: w4a16_matmul_ref(x, qweight, scales, zeros, group_size, bias), x,
                                   residual, next_norm)
    return y if out_dtype is None else y.to(out_dtype)


def w8a16_matmul(x, qweight, scales, bias=None, release_early: bool = False, residual: torch.Tensor | None = None,
                 next_norm: tuple | None = None, out_dtype: torch.dtype | None = None):
    x1 = PendingNorm.rows(x)
    tensors = [x1, qweight, scales] + ([bias] if bias is not None else [])
    if _dtype_ok(x1) and qweight.stride(-1) == 1 and use_triton(*tensors):
        y = w8a16_matmul_triton(x, qweight, scales, bias, release_early=release_early, residual=residual,
                                next_norm=next_norm, out_dtype=out_dtype)
    else:
        y = with_norm_and_residual(lambda x: w8a16_matmul_ref(x, qweight, scales, bias), x, residual, next_norm)
    return y if out_dtype is None else y.to(out_dtype)


def _gated_ok(x, qweight, *tensors) -> bool:
    """The fused gate/up GEMV runs: one row of x, 16-bit (its epilogue rounds as the unfused bf16/fp16 path does),
    weights readable as int32 words, Triton."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16) and qweight.shape[0] % 2 == 0
            and int32_words(qweight) is not None and use_triton(x, qweight, *tensors))


def w4a16_gated_matmul(x, qweight, scales, zeros, group_size, bias=None):
    """silu(x @ W_gate^T) * (x @ W_up^T) for W = [gate; up] int4 (a packed gate/up projection): [..., N / 2]. One
    row of x (batch-1 decode): the MMA GEMV with the activation in its epilogue, one kernel; else the GEMM, then
    silu_and_mul. x may be a PendingNorm."""
    tensors = [scales] + [t for t in (zeros, bias) if t is not None]
    x1 = PendingNorm.rows(x)
    if group_size == 128 and x1.shape[-1] % 128 == 0 and _gated_ok(x1, qweight, *tensors):
        return w4a16_matmul_triton(x, qweight, scales, zeros, group_size, bias, gated=True)
    return silu_and_mul(*w4a16_matmul(x, qweight, scales, zeros, group_size, bias).chunk(2, -1))


def w8a16_gated_matmul(x, qweight, scales, bias=None):
    """As `w4a16_gated_matmul`, int8 weights."""
    tensors = [scales] + ([bias] if bias is not None else [])
    x1 = PendingNorm.rows(x)
    if x1.shape[-1] % 64 == 0 and qweight.stride(-1) == 1 and _gated_ok(x1, qweight, *tensors):
        return w8a16_matmul_triton(x, qweight, scales, bias, gated=True)
    return silu_and_mul(*w8a16_matmul(x, qweight, scales, bias).chunk(2, -1))

