"""The fused MoE layer in Triton (the shape of vLLM/SGLang's fused_moe): the routed experts of
`moe_experts.moe_experts` in two grouped GEMM launches, nothing read back to the host.

1. Align (`align_by_expert`, torch on the device): the T x k (token, choice) pairs sorted by expert, each expert's
   run padded to a multiple of BLOCK_M with a sentinel pair id, and the expert of every BLOCK_M-row block (-1
   past the last run). Fixed sizes from T, k and E only: T*k + min(E, T*k) * (BLOCK_M - 1) rows bound the padded
   runs, so a CUDA graph can hold the whole layer.
2. Gate/up (`_gate_up_kernel`): one program per (block, BLOCK_N columns of the expert width I): the block's rows of
   x gathered by token, both halves of w_gate_up[e] against them, SiLU-and-mul in the epilogue; the [T*k, I]
   activations stored at each pair's row.
3. Down (`_down_kernel`): the same blocking over w_down[e] [H, I], the routing weight multiplied in the epilogue;
   [T*k, H] per pair. A token's k rows are then summed in expert order (the reference's order).
The epilogues round where the reference rounds (the GEMM outputs, silu's output, the product), so the kernel
differs from `moe_experts_ref` only by the GEMMs' summation order. The tiles are tuned per token-count bucket at
warm-up (`aligned_candidates`, through brrr.kernels.quant's TUNED_CONFIGS); `fused_moe_plan` is what runs untuned.

One token (batch-1 decode) takes its own path, `fused_moe_decode`: its k choices are k distinct experts, so there is
nothing to align and the layer is a GEMV per choice, bound by reading the k experts' weights. The grouped GEMMs'
grid is too narrow for that (Mixtral's down: 2 x 4096/64 = 128 programs, each walking K = 14336) and the alignment
and expert-order sum are ~25 tiny torch launches per layer, which bound a CUDA-graph step. Three launches instead:
gate/up (`_decode_gate_up_kernel`, one program per (choice, BLOCK_N columns), w_gate_up[ids[0, j]] read directly,
the same SiLU-and-mul epilogue), down split over K (`_decode_down_kernel`, fp32 partials [SPLIT, k, H]) and a finish
(`_decode_finish_kernel`: the partials summed in split order, rounded, times the routing weight, and the k rows
summed in expert order, found in-kernel). CUDA-core products (tl.sum, fp32 accumulate; fp32 stays exact, no TF32).
`decode_plan` narrows the tiles and splits K until each launch fills the SMs several times over.
"""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import next_power_of_2, sm_count
from brrr.kernels.quant.tune import TUNED_CONFIGS


def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [E] int64, without a host read (bincount reads its max back), so a CUDA graph can hold it."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


def sum_in_expert_order(per_pair: torch.Tensor, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """per_pair [T*k, H] in (token, choice) order -> [T, H]: each token's k rows summed left to right in expert
    order, the order transformers' loop (and `moe_experts_ref`'s index_add) adds them in."""
    k = ids.shape[1]
    rows = per_pair.view(-1, k, per_pair.shape[-1])
    rows = rows.gather(1, ids.argsort(dim=1, stable=True)[..., None].expand(-1, -1, rows.shape[-1]))
    out = torch.zeros_like(like)
    for j in range(k):
        out = out + rows[:, j]
    return out


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [T, k] -> (pairs [R] int32: pair id t*k + j in expert-sorted, block-padded order, T*k for padding;
    block_expert [R / block_m] int32: each block's expert, -1 for blocks past the last run)."""
    flat = ids.flatten()
    n_pairs = flat.numel()
    counts = expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(n_pairs, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    rows = -(-(n_pairs + min(num_experts, n_pairs) * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((rows,), n_pairs, dtype=torch.int32, device=ids.device)
    pairs[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(starts < ends[-1], block_expert, -1).to(torch.int32)
    return pairs, block_expert


def fused_moe_plan(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Tiles for one call. BLOCK_M follows the mean rows per expert (decode: a few rows, so 16, the smallest
    tl.dot takes; prefill: 64), BLOCK_N/K the weight tiles every row block streams."""
    per_expert = tokens * top_k / max(1, min(num_experts, tokens * top_k))
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=64 if inter >= 64 else 32, BLOCK_K=64 if hidden >= 64 else 32,
                num_warps=4 if block_m <= 32 else 8)


def aligned_candidates(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> list[dict]:
    """The aligned kernels' configs the warm-up times at this token count, led by `fused_moe_plan`'s: BLOCK_M
    around the mean rows per expert (the alignment pads each expert's run to it, so past that it only adds
    padding), wider N tiles and deeper pipelines where the layer turns compute-bound. Families (BLOCK_M, warps)
    vary the N/K tiles and stages."""
    rule = fused_moe_plan(tokens, top_k, num_experts, hidden, inter)
    per_expert = tokens * top_k / max(1, min(num_experts, tokens * top_k))
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)]
    configs = [rule]
    for block_m in block_ms:
        for warps in (4, 8):
            for block_n in (64, 128):
                for block_k in (64, 32):  # a family's first (the one a tuning times) the likeliest: K 64
                    for stages in (3, 4):
                        if block_m * block_n <= 8192 and (warps == 8 or block_m * block_n <= 4096):
                            configs.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                num_warps=warps, num_stages=stages))
    return _unique(configs)


def _aligned_family(config: dict) -> tuple:
    return config["BLOCK_M"], config["num_warps"]


def decode_plan(top_k: int, hidden: int, inter: int, sms: int = 132) -> dict:
    """The one-token path's launch plan {"gate_up": config, "down": config} without timing anything (fp32, the
    CPU, a shape never tuned). A GEMV is bound by the weight bytes in flight, so each launch wants several programs
    per SM (4 x sms): gate/up narrows BLOCK_N (32 -> 8) until k * I / BLOCK_N reaches that (its K, the hidden size,
    is short enough to walk whole), down splits its long K (the expert width) into K_PER_SPLIT chunks, whole
    BLOCK_Ks. Each weight tile is ~4096 elements (BLOCK_N x BLOCK_K), rows read along their unit stride."""
    target = 4 * sms
    gu_n = 32
    while gu_n > 8 and top_k * _cdiv(inter, gu_n) < target:
        gu_n //= 2
    gate_up = dict(BLOCK_N=gu_n, BLOCK_K=min(4096 // gu_n, _pow2_at_least(hidden)), num_warps=4, num_stages=3)
    return {"gate_up": gate_up, "down": _down_config(top_k, hidden, inter, 32, min(128, _pow2_at_least(inter)),
                                                     target, num_warps=4, num_stages=3)}


def _down_config(top_k: int, hidden: int, inter: int, block_n: int, block_k: int, programs: int, **launch) -> dict:
    """Down's config splitting K until the grid (k, H / BLOCK_N, splits) has about `programs` programs."""
    split = max(1, min(_cdiv(programs, top_k * _cdiv(hidden, block_n)), _cdiv(inter, block_k), 32))
    k_per_split = _cdiv(_cdiv(inter, split), block_k) * block_k  # whole BLOCK_Ks, so no two splits share one
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=k_per_split, **launch)


def gate_up_candidates(top_k: int, hidden: int, inter: int, sms: int) -> list[dict]:
    """The gate/up configs the warm-up times for the one-token path, led by `decode_plan`'s; families (tile
    width, warps) vary the K step and stages."""
    configs = [decode_plan(top_k, hidden, inter, sms)["gate_up"]]
    for n in (8, 16, 32, 64):
        for warps in (4, 8):
            for k in (128, 256, 512):
                for stages in (2, 4):
                    if n * k <= 16384 and k <= _pow2_at_least(hidden):
                        configs.append(dict(BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages))
    return _unique(configs)


def down_candidates(top_k: int, hidden: int, inter: int, sms: int) -> list[dict]:
    """The down configs, led by `decode_plan`'s; families (tile width, warps) vary the K step and the split."""
    configs = [decode_plan(top_k, hidden, inter, sms)["down"]]
    for n in (16, 32, 64):
        for warps in (4, 8):
            for k in (64, 128, 256):
                for programs in (2 * sms, 4 * sms, 8 * sms):
                    if n * k <= 16384 and k <= _pow2_at_least(inter):
                        configs.append(_down_config(top_k, hidden, inter, n, k, programs, num_warps=warps,
                                                    num_stages=3))
    return _unique(configs)


def _unique(configs: list[dict]) -> list[dict]:
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def _launch_family(config: dict) -> tuple:
    return config["BLOCK_N"], config["num_warps"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    """A tile width: the power of two >= n, at least 16 (tl.dot's and tl.arange's smallest useful one)."""
    return max(16, next_power_of_2(n))


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:

    @triton.jit
    def _gate_up_kernel(X, W, OUT, PAIRS, BLOCK_EXPERT, n_pairs, top_k, hidden, inter, stride_x, stride_we,
                        stride_wn, stride_o, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        block, col = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + block).to(tl.int64)
        if e >= 0:
            pair = tl.load(PAIRS + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            valid = pair < n_pairs
            token = pair // top_k
            n = col * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < inter
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = W + e * stride_we
            for k0 in range(0, hidden, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < hidden
                a = tl.load(X + token[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                            other=0.0)
                w_mask = k_ok[:, None] & n_ok[None, :]
                wg = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
                wu = tl.load(w_base + (n[None, :] + inter) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
                if IEEE:
                    acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                    acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
                else:
                    acc_g = tl.dot(a, wg, acc_g)
                    acc_u = tl.dot(a, wu, acc_u)
            dt = OUT.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)
            u = acc_u.to(dt).to(tl.float32)
            s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
            tl.store(OUT + pair[:, None] * stride_o + n[None, :], (s * u).to(dt), mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(A, W, WEIGHTS, OUT, PAIRS, BLOCK_EXPERT, n_pairs, hidden, inter, stride_a, stride_we,
                     stride_wn, stride_o, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        block, col = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + block).to(tl.int64)
        if e >= 0:
            pair = tl.load(PAIRS + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            valid = pair < n_pairs
            n = col * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < hidden
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = W + e * stride_we
            for k0 in range(0, inter, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < inter
                a = tl.load(A + pair[:, None] * stride_a + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                            other=0.0)
                w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                            other=0.0)
                if IEEE:
                    acc = tl.dot(a, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
            dt = OUT.dtype.element_ty
            r = tl.load(WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)
            y = acc.to(dt).to(tl.float32) * r[:, None]
            tl.store(OUT + pair[:, None] * stride_o + n[None, :], y.to(dt), mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _decode_gate_up_kernel(X, IDS, W, ACT, stride_ids, hidden, inter, stride_we, stride_wn,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        j, col = tl.program_id(0), tl.program_id(1)
        e = tl.load(IDS + j * stride_ids).to(tl.int64)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_gate = W + e * stride_we + n[:, None] * stride_wn
        w_up = w_gate + inter * stride_wn
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w_mask = n_ok[:, None] & k_ok[None, :]
            acc_g += tl.sum(tl.load(w_gate + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
            acc_u += tl.sum(tl.load(w_up + kk[None, :], mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
        dt = ACT.dtype.element_ty  # the roundings of _gate_up_kernel's epilogue
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(ACT + j * inter + n, (s * u).to(dt), mask=n_ok)

    @triton.jit
    def _decode_down_kernel(ACT, IDS, W, PARTIAL, stride_ids, top_k, hidden, inter, k_per_split, stride_we,
                            stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        j, col, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        e = tl.load(IDS + j * stride_ids).to(tl.int64)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_rows = W + e * stride_we + n[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_lo = split * k_per_split
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            a = tl.load(ACT + j * inter + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a, axis=1)
        tl.store(PARTIAL + (split * top_k + j) * hidden + n, acc, mask=n_ok)

    @triton.jit
    def _decode_finish_kernel(PARTIAL, IDS, WEIGHTS, OUT, stride_ids, stride_w, top_k, hidden, splits,
                              K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        choice = tl.arange(0, K_PAD)
        ids = tl.load(IDS + choice * stride_ids, mask=choice < top_k, other=2147483647)
        # each choice's place in ascending expert order, ties by choice (sum_in_expert_order's stable argsort)
        before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (choice[None, :] < choice[:, None]))
        place = tl.sum(before.to(tl.int32), axis=1)
        dt = OUT.dtype.element_ty
        out = tl.zeros((BLOCK_H,), dtype=tl.float32)  # holds dt values: rounded after every add
        for p in range(0, top_k):
            j = tl.sum(tl.where(place == p, choice, 0))
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for split in range(0, splits):  # a fixed order: the same bits on every run
                acc += tl.load(PARTIAL + (split * top_k + j) * hidden + h, mask=h_ok, other=0.0)
            r = tl.load(WEIGHTS + j * stride_w).to(tl.float32)
            y = (acc.to(dt).to(tl.float32) * r).to(dt)  # as _down_kernel's epilogue
            out = (out + y.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(OUT + h, out.to(dt), mask=h_ok)


def fused_moe_decode(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, plan: dict | None = None) -> torch.Tensor:
    """`fused_moe_triton` for one token (x [1, H]): three launches, no alignment, nothing read back to the host.
    plan: {"gate_up": config, "down": config}; default: each kernel's config tuned at warm-up for this shape."""
    hidden, inter, top_k = x.shape[1], w_down.shape[2], ids.shape[1]
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    if plan is None:  # (what a tuning session times: each kernel on this call's tensors)
        plan = _tuned_decode_plan(x, top_k, hidden, inter,
                                  lambda cfg, w=None: _decode_gate_up(x, ids, w_gate_up, act, cfg),
                                  lambda cfg, w=None: _decode_down(act, ids, w_down, cfg))
    _decode_gate_up(x, ids, w_gate_up, act, plan["gate_up"])
    return finish_decode(_decode_down(act, ids, w_down, plan["down"]), weights, ids, x)


def _tuned_decode_plan(x, top_k: int, hidden: int, inter: int, run_gate_up, run_down) -> dict:
    """Each kernel's config from TUNED_CONFIGS (timed among `gate_up_candidates` / `down_candidates` inside the
    warm-up's `quant_tuning`, kept on disk per GPU); fp32 and shapes never tuned take `decode_plan`."""
    sms = sm_count(x.device)
    rule = decode_plan(top_k, hidden, inter, sms)
    if x.dtype == torch.float32 or x.device.type != "cuda":
        return rule
    shape = (top_k, hidden, inter, x.dtype)
    gate_up = TUNED_CONFIGS.config(x.device, ("moe_decode_gate_up",) + shape, 1,
                                   lambda: gate_up_candidates(top_k, hidden, inter, sms), run_gate_up,
                                   default=rule["gate_up"], family=_launch_family)
    down = TUNED_CONFIGS.config(x.device, ("moe_decode_down",) + shape, 1,
                                lambda: down_candidates(top_k, hidden, inter, sms), run_down, default=rule["down"],
                                family=_launch_family)
    return {"gate_up": gate_up, "down": down}


def _decode_gate_up(x, ids, w_gate_up, act, cfg: dict) -> None:
    top_k, inter = act.shape
    grid = (top_k, triton.cdiv(inter, cfg["BLOCK_N"]))
    _decode_gate_up_kernel[grid](x, ids, w_gate_up, act, ids.stride(1), x.shape[1], inter, w_gate_up.stride(0),
                                 w_gate_up.stride(1), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _decode_down(act, ids, w_down, cfg: dict) -> torch.Tensor:
    """Down's fp32 split-K partials [SPLIT, k, H]."""
    top_k, inter = act.shape
    hidden = w_down.shape[1]
    splits = triton.cdiv(inter, cfg["K_PER_SPLIT"])
    partial = torch.empty(splits, top_k, hidden, dtype=torch.float32, device=act.device)
    grid = (top_k, triton.cdiv(hidden, cfg["BLOCK_N"]), splits)
    _decode_down_kernel[grid](act, ids, w_down, partial, ids.stride(1), top_k, hidden, inter, cfg["K_PER_SPLIT"],
                              w_down.stride(0), w_down.stride(1), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return partial


def finish_decode(partial: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """partial [SPLIT, k, H] fp32 (down's split-K sums) -> [1, H] in like's dtype: the splits summed in order, each
    choice's row rounded, weighted and rounded as `_down_kernel` does, the rows summed as `sum_in_expert_order`."""
    splits, top_k, hidden = partial.shape
    out = torch.empty_like(like)
    block_h = min(128, _pow2_at_least(hidden))  # a few dozen programs: its loads are a short dependent chain
    _decode_finish_kernel[(triton.cdiv(hidden, block_h),)](partial, ids, weights, out, ids.stride(1),
                                                           weights.stride(1), top_k, hidden, splits,
                                                           K_PAD=_pow2_at_least(top_k), BLOCK_H=block_h,
                                                           num_warps=4)
    return out


def fused_moe_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, plan: dict | None = None) -> torch.Tensor:
    """x [T, H]; weights [T, k] (fp32), ids [T, k]; w_gate_up [E, 2I, H], w_down [E, H, I] (last dims unit-stride)
    -> [T, H], as `moe_experts_ref`. One token takes the GEMV path (`fused_moe_decode`) unless a plan is given;
    more take the aligned kernels with the config tuned for their token-count bucket."""
    if x.shape[0] == 1 and plan is None:
        return fused_moe_decode(x, weights, ids, w_gate_up, w_down)
    if plan is None:
        plan = _tuned_aligned_plan(x, weights, ids, w_gate_up, w_down)
    return _fused_moe_aligned(x, weights, ids, w_gate_up, w_down, plan)


def _tuned_aligned_plan(x, weights, ids, w_gate_up, w_down) -> dict:
    """The aligned kernels' config from TUNED_CONFIGS by token-count bucket (timed among `aligned_candidates`
    inside the warm-up's `quant_tuning`, kept on disk per GPU); fp32 and buckets never tuned: `fused_moe_plan`."""
    tokens, hidden = x.shape
    num_experts, inter, top_k = w_gate_up.shape[0], w_down.shape[2], ids.shape[1]
    rule = fused_moe_plan(tokens, top_k, num_experts, hidden, inter)
    if x.dtype == torch.float32 or x.device.type != "cuda" or tokens * top_k <= 16 * num_experts:
        # fp32, the CPU, and decode-sized loads (at most 16 rows an expert: one 16-row tile) run the rule: there
        # the tuned tiles were slower in the engine than in their timing (Qwen3-30B-A3B batch 64 on the H200:
        # 1,982.5 tuned vs 2,781.1 tok/s with the rule, one call)
        return rule
    even = []  # made on the first timed run only (a lookup that hits never times anything)

    def run(cfg, w=None):
        # Timed on an even routing, not this call's: a warm-up batch repeats one token, which sends every row to
        # the same k experts, a load serving never sees.
        if not even:
            even.append(even_routing(tokens, top_k, num_experts, ids))
        return _fused_moe_aligned(x, weights, even[0], w_gate_up, w_down, cfg)
    return TUNED_CONFIGS.config(
        x.device, ("moe_aligned", num_experts, top_k, hidden, inter, x.dtype), tokens,
        lambda: aligned_candidates(tokens, top_k, num_experts, hidden, inter), run, default=rule,
        family=_aligned_family)


def even_routing(tokens: int, top_k: int, num_experts: int, like: torch.Tensor) -> torch.Tensor:
    """ids [tokens, top_k] with each token's experts distinct (top_k <= num_experts) and every expert's row count
    within one of the others': the load a balanced router gives, on like's device and dtype."""
    return (torch.arange(tokens * top_k, device=like.device) % num_experts).view(tokens, top_k).to(like.dtype)


def _fused_moe_aligned(x, weights, ids, w_gate_up, w_down, plan: dict) -> torch.Tensor:
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    top_k = ids.shape[1]
    bm, bn, bk = plan["BLOCK_M"], plan["BLOCK_N"], plan["BLOCK_K"]
    launch = dict(num_warps=plan["num_warps"], **({"num_stages": plan["num_stages"]} if "num_stages" in plan else {}))
    pairs, block_expert = align_by_expert(ids, num_experts, bm)
    n_pairs = tokens * top_k
    ieee = x.dtype == torch.float32  # fp32 stays fp32 (no TF32), as the reference's matmuls
    act = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (block_expert.shape[0], triton.cdiv(inter, bn))
    _gate_up_kernel[grid](x, w_gate_up, act, pairs, block_expert, n_pairs, top_k, hidden, inter, x.stride(0),
                          w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), IEEE=ieee, BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=bk, **launch)
    per_pair = torch.empty(n_pairs, hidden, dtype=x.dtype, device=x.device)
    grid = (block_expert.shape[0], triton.cdiv(hidden, bn))
    _down_kernel[grid](act, w_down, weights.float().contiguous(), per_pair, pairs, block_expert, n_pairs, hidden,
                       inter, act.stride(0), w_down.stride(0), w_down.stride(1), per_pair.stride(0), IEEE=ieee,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **launch)
    return sum_in_expert_order(per_pair, ids, x)


def fused_moe_ok(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    return (triton is not None and x.dim() == 2 and x.shape[0] > 0 and x.dtype == w_gate_up.dtype == w_down.dtype
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.stride(-1) == 1
            and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1)
