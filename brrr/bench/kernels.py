"""`brrr bench kernels`: each Triton kernel in brrr/kernels against its torch / SDPA peer, on this GPU.

For every op and shape it times the Triton kernel and its peers in the same process (triton.testing.do_bench:
median of repeated runs, L2 flushed between them), and prints one JSON record per (op, shape): the time, GB/s
and TFLOP/s of each implementation, and the fraction of the roofline reached: the op's minimum time (its FLOPs over
the measured bf16 matmul rate, or its bytes over the measured copy bandwidth, whichever is longer; counts from
brrr.analysis.kernels) over the measured time. --plot draws those ops on the measured roofline.

Peers: the plain-torch references (`<op>_ref`, eager), torch.nn.functional.rms_norm where torch has it, and
scaled_dot_product_attention's flash and cuDNN backends over contiguous K/V for attention (GQA through
enable_gqa, or K/V expanded to every query head when a backend refuses it).
"""
from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone

from brrr.analysis.hardware import GPU, _known_spec, measure
from brrr.analysis.kernels import (decode_attention_op, fused_moe_op, kv_write_op, mla_decode_op, prefill_attention_op,
                                   rms_norm_op, rotary_op, silu_and_mul_op)
from brrr.analysis.roofline import Op, place, plot
from brrr.cli import HelpFormatter
from brrr.config import RopeConfig
from brrr.errors import BrrrError
from brrr.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from brrr.kernels.attention import decode_attention_triton, write_kv_ref, write_kv_triton
from brrr.kernels.attention.plan import decode_splits
from brrr.kernels.attention.prefill import prefill_attention_triton, tuned_prefill_config
from brrr.kernels.dispatch import triton_available
from brrr.kernels.fused_moe import fused_moe_triton
from brrr.kernels.mla_attention import mla_decode_ref
from brrr.kernels.mla_decode import mla_decode_latent_triton
from brrr.kernels.moe_experts import moe_experts_grouped_mm, moe_experts_ref
from brrr.kernels.moe_routing import route_ref
from brrr.kernels.quant import quant_tuning
from brrr.kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from brrr.kernels.rotary import apply_rotary_ref, apply_rotary_triton, rope_inv_freq, rotary_cos_sin

OPS = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "kv_write", "decode", "decode_fp8", "prefill",
       "fused_moe", "mla_decode")
# Mixtral-8x7B's MoE layer (8 experts, top 2, hidden 4096, expert width 14336) at these token counts
MOE_EXPERTS, MOE_TOP_K, MOE_INTER, MOE_TOKENS = 8, 2, 14336, (1, 16, 64, 256, 1024)
# Llama-3.1-8B: hidden 4096, MLP 14336, 32 query heads, 8 kv heads, head dim 128.
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16
DECODE_SHAPES = ((64, 4096), (64, 16384), (1, 32768), (16, 8192))  # (batch, context)
# MLA's latent cache: DeepSeek-V2-Lite's 16 heads (V3: 128) over rank-512 latents and a 64-wide rotary key
MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_SHAPES = (16, 128), 512, 64, ((64, 4096), (1, 32768))
PREFILL_SHAPES = ((8, 2048), (4, 4096), (2, 8192), (1, 16384))  # (batch, tokens): 16k tokens each
DECODE_SWEEP = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3))  # block_n, warps, stages
DECODE_SWEEP_SHAPES = {(64, 4096): (1, 2), (16, 8192): (1, 3, 5, 8), (1, 32768): (16, 33, 64)}  # -> splits


def register(bench_sub) -> None:
    p = bench_sub.add_parser("kernels", help="Triton kernels vs torch/SDPA peers: GB/s, TFLOP/s, roofline fraction",
                             formatter_class=HelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--tokens", type=int, default=16384, help="rows for the elementwise ops (RMSNorm, RoPE, ...)")
    p.add_argument("--quick", action="store_true", help="one shape per attention op (a smoke run)")
    p.add_argument("--sweep", action="store_true",
                   help="also time the decode kernel's tile and split choices at b=64 x 4k, 16 x 8k, 1 x 32k")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="also write the records here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the ops and what they reached on the "
                   "measured roofline")
    p.add_argument("--replot", default=None, metavar="FILE.jsonl",
                   help="no benchmark: draw --plot from the records of an earlier run (no GPU needed)")
    p.set_defaults(func=cmd)


def replot(records_path: str, png: str) -> str:
    """The roofline plot of an earlier run, from its JSON records (the machine's measured ceilings are in them)."""
    from dataclasses import replace

    try:
        records = [json.loads(line) for line in open(records_path) if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise BrrrError(f"--replot: cannot read records from {records_path}: {e}") from None
    runs = [r for r in records if "triton" in r and r.get("flops")]
    if not runs:
        raise BrrrError(f"--replot: {records_path} holds no `brrr bench kernels` records")
    m = runs[0]["machine"]
    base = _known_spec(m["gpu"]) or GPU(m["gpu"], 0, 0)
    gpu = replace(base, name=f"{m['gpu']} (measured)", bandwidth=m["copy_bandwidth"],
                  flops={**base.flops, "bf16": m["bf16_matmul_flops"], "fp16": m["bf16_matmul_flops"]},
                  source=f"measured copy and bf16 matmul, torch {m['torch']}, triton {m['triton']}", datasheet=base)
    ops = [Op(r["op"], r["flops"], r["bytes"]) for r in runs]
    return plot(gpu, ops, png, achieved={r["op"]: r["flops"] / r["triton"]["time_s"] for r in runs})


def cmd(args) -> int:
    import torch

    if args.replot:
        if not args.plot:
            raise BrrrError("--replot needs --plot FILE.png (where to draw it)")
        print(json.dumps({"plot": replot(args.replot, args.plot)}))
        return 0
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise BrrrError(f"--ops: unknown op {bad[0]!r}; choose from {', '.join(OPS)}")
    if args.tokens < 1:
        raise BrrrError(f"--tokens must be >= 1, got {args.tokens}")
    if not torch.cuda.is_available():
        raise BrrrError("brrr bench kernels needs a CUDA GPU, and torch sees none")
    if not triton_available():
        raise BrrrError("brrr bench kernels needs triton (pip install triton), which does not import here")
    bench = KernelBench(args)
    failed = 0
    for op in ops + (["decode_sweep"] if args.sweep else []):
        try:
            getattr(bench, op)()
        except Exception as e:  # one op failing (a compile error, out of memory) must not lose the others
            failed += 1
            print(json.dumps({"bench": "kernels", "op": op, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
    if args.plot:
        print(json.dumps({"plot": bench.plot(args.plot)}), file=sys.stderr)
    return 1 if failed else 0


class KernelBench:
    def __init__(self, args):
        import torch
        import triton

        self.torch, self.triton, self.args = torch, triton, args
        self.gpu = measure()
        self.out = open(args.out, "a") if args.out else None
        self.machine = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": self.gpu.bandwidth,
                        "bf16_matmul_flops": self.gpu.peak("bf16"), "torch": torch.__version__,
                        "triton": triton.__version__, "python": platform.python_version()}
        self.placed: list = []  # (Op, achieved FLOP/s) for the plot
        self.gen = torch.Generator(device="cuda").manual_seed(0)

    # -- plumbing ------------------------------------------------------------------------------------------
    def randn(self, *shape, dtype=None):
        torch = self.torch
        return torch.randn(*shape, device="cuda", generator=self.gen).to(dtype or torch.bfloat16)

    def time(self, fn) -> float:
        """Median seconds per call (after one untimed call, which also compiles and autotunes)."""
        fn()
        self.torch.cuda.synchronize()
        return self.triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def emit(self, op, shape: dict, triton_s: float, peers: dict, extra: dict | None = None):
        """One record: the Triton kernel's time and rates, each peer's, and the roofline fraction."""
        spot = place(op, self.gpu)

        def rates(seconds):
            return {"time_s": seconds, "gbps": op.bytes / seconds / 1e9, "tflops": op.flops / seconds / 1e12}

        record = {"bench": "kernels", "op": op.name, "shape": shape, "dtype": "bf16", "flops": op.flops,
                  "bytes": op.bytes, "bound": spot["bound"], "min_time_s": spot["min_time_s"],
                  "triton": rates(triton_s), "roofline_fraction": spot["min_time_s"] / triton_s,
                  "peers": {}, **(extra or {})}
        for name, seconds in peers.items():
            if isinstance(seconds, str):
                record["peers"][name] = {"error": seconds}
            else:
                record["peers"][name] = {**rates(seconds), "roofline_fraction": spot["min_time_s"] / seconds,
                                         "triton_speedup": seconds / triton_s}
        record["machine"] = self.machine
        record["when"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        line = json.dumps(record)
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()
        if op.flops > 0:
            self.placed.append((op, op.flops / triton_s))
        return record

    def try_time(self, fn):
        try:
            return self.time(fn)
        except Exception as e:  # a backend that refuses the shape: recorded as such, the run goes on
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    # -- elementwise ops -----------------------------------------------------------------------------------
    def rms_norm(self):
        n = self.args.tokens
        x, w = self.randn(n, HIDDEN), self.randn(HIDDEN)
        peers = {"torch_reference": self.time(lambda: rms_norm_ref(x, w, 1e-5))}
        if hasattr(self.torch.nn.functional, "rms_norm"):
            peers["F.rms_norm"] = self.try_time(lambda: self.torch.nn.functional.rms_norm(x, (HIDDEN,), w, 1e-5))
        self.emit(rms_norm_op(n, HIDDEN), {"tokens": n, "hidden": HIDDEN},
                  self.time(lambda: rms_norm_triton(x, w, 1e-5)), peers)

    def add_rms_norm(self):
        n = self.args.tokens
        x, r, w = self.randn(n, HIDDEN), self.randn(n, HIDDEN), self.randn(HIDDEN)
        self.emit(rms_norm_op(n, HIDDEN, residual=True), {"tokens": n, "hidden": HIDDEN},
                  self.time(lambda: add_rms_norm_triton(x, r, w, 1e-5)),
                  {"torch_reference": self.time(lambda: add_rms_norm_ref(x, r, w, 1e-5))})

    def rotary(self):
        n = self.args.tokens
        rope = RopeConfig("llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192})
        inv_freq, scale = rope_inv_freq(rope, HEAD_DIM, 131072)
        positions = self.torch.arange(n, device="cuda")
        cos, sin = rotary_cos_sin(positions, inv_freq.cuda(), scale, self.torch.bfloat16)
        q, k = self.randn(n, HEADS, HEAD_DIM), self.randn(n, KV_HEADS, HEAD_DIM)
        self.emit(rotary_op(n, HEADS, KV_HEADS, HEAD_DIM), {"tokens": n, "heads": HEADS, "kv_heads": KV_HEADS,
                                                            "head_dim": HEAD_DIM, "scaling": "llama3"},
                  self.time(lambda: apply_rotary_triton(q, k, cos, sin)),
                  {"torch_reference": self.time(lambda: apply_rotary_ref(q, k, cos, sin))})

    def silu_and_mul(self):
        n = max(1, self.args.tokens // 4)
        gate, up = self.randn(n, MLP), self.randn(n, MLP)
        self.emit(silu_and_mul_op(n, MLP), {"tokens": n, "width": MLP},
                  self.time(lambda: silu_and_mul_triton(gate, up)),
                  {"torch_reference": self.time(lambda: silu_and_mul_ref(gate, up))})

    def kv_write(self):
        torch, n = self.torch, self.args.tokens
        blocks = 2 * n // BLOCK
        k_cache = torch.empty(blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        k, v = self.randn(n, KV_HEADS, HEAD_DIM), self.randn(n, KV_HEADS, HEAD_DIM)
        slots = torch.randperm(blocks * BLOCK, device="cuda")[:n]
        self.emit(kv_write_op(n, KV_HEADS, HEAD_DIM), {"tokens": n, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
                  self.time(lambda: write_kv_triton(k, v, k_cache, v_cache, slots)),
                  {"torch_reference": self.time(lambda: write_kv_ref(k, v, k_cache, v_cache, slots))})

    # -- mixture of experts ---------------------------------------------------------------------------------
    def fused_moe(self):
        """The routed experts at Mixtral-8x7B's shape, random routing: the fused kernel, torch._grouped_mm over
        expert-sorted runs, and the per-expert loop (transformers' and the reference model's)."""
        torch = self.torch
        w_gate_up = self.randn(MOE_EXPERTS, 2 * MOE_INTER, HIDDEN) * 0.02
        w_down = self.randn(MOE_EXPERTS, HIDDEN, MOE_INTER) * 0.02
        loop_experts = [(w[:MOE_INTER], w[MOE_INTER:], d) for w, d in zip(w_gate_up, w_down)]
        for tokens in ((1, 64) if self.args.quick else MOE_TOKENS):
            x = self.randn(tokens, HIDDEN)
            weights, ids = route_ref(self.randn(tokens, MOE_EXPERTS, dtype=torch.float32), MOE_TOP_K, renormalize=True)
            run = int((torch.bincount(ids.flatten(), minlength=MOE_EXPERTS) > 0).sum())
            peers = {"grouped_mm": self.try_time(lambda: moe_experts_grouped_mm(x, weights, ids, w_gate_up, w_down)),
                     "per_expert_loop": self.try_time(lambda: moe_experts_ref(x, weights, ids, loop_experts))}
            with quant_tuning():  # the one-token path's configs, tuned as the engine's warm-up tunes them
                fused_moe_triton(x, weights, ids, w_gate_up, w_down)
            self.emit(fused_moe_op(tokens, MOE_TOP_K, run, HIDDEN, MOE_INTER),
                      {"tokens": tokens, "experts": MOE_EXPERTS, "top_k": MOE_TOP_K, "hidden": HIDDEN,
                       "inter": MOE_INTER, "experts_run": run},
                      self.time(lambda: fused_moe_triton(x, weights, ids, w_gate_up, w_down)), peers)

    def mla_decode(self):
        """MLA's absorbed decode over a shuffled paged latent cache: the Triton latent attention (the cache rows
        read once for all heads) beside the torch reference's whole decode (its gather, fp32 scores and softmax)."""
        torch = self.torch
        for heads in MLA_HEADS:
            for batch, context in MLA_SHAPES[:1] if self.args.quick else MLA_SHAPES:
                per_seq = -(-context // BLOCK)
                cache = self.randn(batch * per_seq, BLOCK, 1, MLA_RANK + MLA_ROPE)
                tables = torch.randperm(batch * per_seq, device="cuda", generator=self.gen).to(torch.int32)
                tables = tables.view(batch, per_seq)
                ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                q = self.randn(batch, heads, MLA_RANK + MLA_ROPE)
                scale = (128 + MLA_ROPE) ** -0.5
                seconds = self.time(lambda: mla_decode_latent_triton(q, cache, tables, ctx, MLA_RANK, scale))
                # the reference with W_kb = I on the first r query dims and W_vb = I: the same latent attention
                eye = torch.eye(MLA_RANK, device="cuda", dtype=q.dtype).expand(heads, -1, -1)
                peers = {"torch_reference": self.try_time(lambda: mla_decode_ref(
                    q[..., :MLA_RANK], q[..., MLA_RANK:], cache, tables, ctx, eye, eye, scale))}
                self.emit(mla_decode_op(batch, context, heads, MLA_RANK, MLA_ROPE),
                          {"batch": batch, "context": context, "heads": heads, "rank": MLA_RANK, "rope": MLA_ROPE,
                           "block_size": BLOCK, "paged": True}, seconds, peers)

    # -- attention -----------------------------------------------------------------------------------------
    def _paged(self, batch, context):
        """A shuffled paged cache holding `context` tokens for each of `batch` sequences, and its block tables."""
        torch = self.torch
        per_seq = -(-context // BLOCK)
        blocks = batch * per_seq
        k_cache = self.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        v_cache = self.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        tables = torch.randperm(blocks, device="cuda", generator=self.gen).to(torch.int32).view(batch, per_seq)
        return k_cache, v_cache, tables

    def _sdpa(self, backend, q, k, v, causal=False, mask=None):
        """(name suffix, seconds or error) for one SDPA backend over contiguous [B, H, S, D] tensors: GQA through
        enable_gqa, else K/V expanded to every query head (the suffix says so)."""
        torch = self.torch
        from torch.nn.attention import sdpa_kernel

        sdpa = torch.nn.functional.scaled_dot_product_attention

        def native():
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        result = self.try_time(native)
        if not isinstance(result, str) or k.shape[1] == q.shape[1]:
            return "", result
        groups = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

        def expanded():
            with sdpa_kernel(backend):
                return sdpa(q, ke, ve, attn_mask=mask, is_causal=causal)
        second = self.try_time(expanded)
        if isinstance(second, str):
            return "", f"{result}; with K/V expanded: {second}"
        return "_kv_expanded", second

    def _sdpa_peers(self, q, k, v, causal):
        from torch.nn.attention import SDPBackend

        peers = {}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            suffix, result = self._sdpa(backend, q, k, v, causal)
            peers[name + suffix] = result
        return peers

    def decode(self):
        for batch, context in DECODE_SHAPES[:1] if self.args.quick else DECODE_SHAPES:
            k_cache, v_cache, tables, q, cu, ctx, out = self._decode_case(batch, context)
            scale = HEAD_DIM**-0.5
            seconds = self.time(lambda: decode_attention_triton(q, k_cache, v_cache, cu, ctx, tables, scale,
                                                                max_context_len=context, out=out))
            # peers on contiguous K/V (what SDPA reads): the same tokens, gathered out of the pages once
            k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()  # [B, KVH, ctx, D]
            v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
            peers = self._sdpa_peers(q[:, :, None, :], k, v, causal=False)
            splits = decode_splits(batch, KV_HEADS, context, q.device)[0]
            self.emit(decode_attention_op(batch, context, HEADS, KV_HEADS, HEAD_DIM),
                      {"batch": batch, "context": context, "heads": HEADS, "kv_heads": KV_HEADS,
                       "head_dim": HEAD_DIM, "block_size": BLOCK, "paged": True}, seconds, peers,
                      {"splits": splits})

    def _decode_case(self, batch, context):
        """A decode step's inputs: the paged cache and tables, one query a sequence, its offsets, lengths, out."""
        torch = self.torch
        k_cache, v_cache, tables = self._paged(batch, context)
        q = self.randn(batch, HEADS, HEAD_DIM)
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return k_cache, v_cache, tables, q, cu, ctx, torch.empty_like(q)

    def decode_fp8(self):
        """The same decode over an fp8 (e4m3) cache with per-tensor scales, dequantized in registers: half the
        bytes, so about half the time is the ideal; the bf16 kernel at the same shape is the peer."""
        torch = self.torch
        for batch, context in DECODE_SHAPES[:1] if self.args.quick else DECODE_SHAPES:
            k_cache, v_cache, tables, q, cu, ctx, out = self._decode_case(batch, context)
            scale = HEAD_DIM**-0.5
            fp8 = [c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache)]
            scales = tuple(torch.ones(1, dtype=torch.float32, device="cuda") for _ in range(2))
            seconds = self.time(lambda: decode_attention_triton(q, *fp8, cu, ctx, tables, scale,
                                                                max_context_len=context, out=out, kv_scales=scales))
            peers = {"triton_bf16_kv": self.try_time(lambda: decode_attention_triton(
                q, k_cache, v_cache, cu, ctx, tables, scale, max_context_len=context, out=out))}
            self.emit(decode_attention_op(batch, context, HEADS, KV_HEADS, HEAD_DIM, kv_bytes=1),
                      {"batch": batch, "context": context, "heads": HEADS, "kv_heads": KV_HEADS,
                       "head_dim": HEAD_DIM, "block_size": BLOCK, "paged": True, "kv_cache_dtype": "fp8_e4m3"},
                      seconds, peers)

    def decode_sweep(self):
        """Tile and split choices of the decode kernel at three shapes (a full batch, a partial wave, one long
        sequence), one record each: what the split heuristic (decode_splits) is checked against."""
        for (batch, context), split_choices in DECODE_SWEEP_SHAPES.items():
            k_cache, v_cache, tables, q, cu, ctx, out = self._decode_case(batch, context)
            op = decode_attention_op(batch, context, HEADS, KV_HEADS, HEAD_DIM)
            for splits in split_choices:
                for block_n, warps, stages in DECODE_SWEEP:
                    seconds = self.try_time(lambda: decode_attention_triton(
                        q, k_cache, v_cache, cu, ctx, tables, HEAD_DIM**-0.5, max_context_len=context, out=out,
                        num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages))
                    config = {"batch": batch, "context": context, "splits": splits, "block_n": block_n,
                              "num_warps": warps, "num_stages": stages}
                    record = {"bench": "kernels", "op": op.name, "sweep": config}
                    if isinstance(seconds, str):
                        record["error"] = seconds
                    else:
                        record.update(time_s=seconds, gbps=op.bytes / seconds / 1e9,
                                      roofline_fraction=op.bytes / self.gpu.bandwidth / seconds)
                    print(json.dumps(record), flush=True)
                    if self.out:
                        self.out.write(json.dumps(record) + "\n")

    def prefill(self):
        torch = self.torch
        for batch, tokens in PREFILL_SHAPES[1:2] if self.args.quick else PREFILL_SHAPES:
            n = batch * tokens
            q, k, v = self.randn(n, HEADS, HEAD_DIM), self.randn(n, KV_HEADS, HEAD_DIM), self.randn(n, KV_HEADS,
                                                                                                    HEAD_DIM)
            cu = torch.arange(0, n + 1, tokens, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            seconds = self.time(lambda: prefill_attention_triton(q, k, v, cu, tokens, HEAD_DIM**-0.5, out=out))
            config = tuned_prefill_config()
            qs, ks, vs = (t.view(batch, tokens, t.shape[1], HEAD_DIM).transpose(1, 2).contiguous() for t in (q, k, v))
            peers = self._sdpa_peers(qs, ks, vs, causal=True)
            self.emit(prefill_attention_op(batch, tokens, HEADS, KV_HEADS, HEAD_DIM),
                      {"batch": batch, "tokens": tokens, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                       "causal": True}, seconds, peers, {"config": str(config) if config else None})
        self._prefill_with_prefix()

    def _prefill_with_prefix(self):
        """A 4k-token chunk over a 4k-token cached prefix (paged), one sequence; no SDPA peer reads a paged
        cache, so the peer is SDPA (efficient backend, explicit mask) over the same tokens made contiguous."""
        torch = self.torch
        prefix, new = 4096, 4096
        k_cache, v_cache, tables = self._paged(1, prefix + new)
        q, k, v = self.randn(new, HEADS, HEAD_DIM), self.randn(new, KV_HEADS, HEAD_DIM), self.randn(new, KV_HEADS,
                                                                                                    HEAD_DIM)
        slots = (tables[0].long()[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()[prefix:]
        write_kv_triton(k, v, k_cache, v_cache, slots)
        cu = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        ctx = torch.tensor([prefix + new], dtype=torch.int32, device="cuda")
        seconds = self.time(lambda: prefill_attention_triton(q, k, v, cu, new, HEAD_DIM**-0.5, k_cache, v_cache, ctx,
                                                             tables))
        kc = k_cache[tables[0].long()].flatten(0, 1).transpose(0, 1)[None].contiguous()
        vc = v_cache[tables[0].long()].flatten(0, 1).transpose(0, 1)[None].contiguous()
        qs = q.transpose(0, 1)[None].contiguous()
        pos = torch.arange(prefix + new, device="cuda")
        mask = pos[None, :] <= pos[prefix:, None]
        from torch.nn.attention import SDPBackend

        suffix, peer = self._sdpa(SDPBackend.EFFICIENT_ATTENTION, qs, kc, vc, mask=mask)
        self.emit(prefill_attention_op(1, new, HEADS, KV_HEADS, HEAD_DIM, prefix=prefix),
                  {"batch": 1, "tokens": new, "prefix": prefix, "heads": HEADS, "kv_heads": KV_HEADS,
                   "head_dim": HEAD_DIM, "causal": True, "paged_prefix": True}, seconds,
                  {"sdpa_efficient_masked" + suffix: peer})

    def plot(self, path: str) -> str:
        ops = [op for op, _ in self.placed]
        return plot(self.gpu, ops, path, achieved={op.name: got for op, got in self.placed})
