"""Ring attention over the context-parallel ranks, with head-tail load balancing, as an autograd.Function whose
backward is a second ring (torch.distributed P2P moves tensors, not autograd history).

The sequence of T tokens is cut into 2N chunks of c = T / 2N; rank r of N holds chunks r and 2N-1-r (its "head"
and "tail"), so under a causal mask every rank has the same work: step s brings rank r the K/V of rank r-s, and
of the 2 x 2 (query chunk, key chunk) pairs exactly half a block's worth is visible for s > 0 (a key chunk before
the query chunk: no mask; the same chunk: causal; after it: skipped). Without the balancing, rank N-1 would see
N blocks and rank 0 one.

Forward: N steps; each step sends this rank's current K/V to rank r+1 and receives rank r-1's
(`batch_isend_irecv`) while the current block is computed (brrr.kernels.attention.lse: the plain-torch block with
its log-sum-exp), and merges the block into the running output by log-sum-exp. Backward: the same ring again,
recomputing each block from the combined (out, lse); dK/dV accumulators travel with their K/V and one last hop
brings every rank its own block's gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from brrr.kernels.attention.lse import attention_lse_backward_ref, attention_lse_ref, merge_lse


class Ring:
    """This rank's place in the context-parallel ring: the group, its size N, this rank's index, the chunk length c
    and the sliding window (None: plain causal)."""

    def __init__(self, group, chunk: int, sliding_window: int | None = None):
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.chunk, self.sliding_window = chunk, sliding_window
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The head and tail chunk indices of a rank (head-tail load balancing)."""
        return rank, 2 * self.world - 1 - rank

    def pair_mask(self, q_chunk: int, k_chunk: int, device):
        """(visible, mask) of a (query chunk, key chunk) pair: mask None when every key is visible."""
        c, window = self.chunk, self.sliding_window
        if k_chunk > q_chunk:
            return False, None
        if window is None:
            if k_chunk < q_chunk:
                return True, None
            return True, torch.ones(c, c, dtype=torch.bool, device=device).tril()
        q_pos = q_chunk * c + torch.arange(c, device=device)[:, None]
        k_pos = k_chunk * c + torch.arange(c, device=device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return bool(mask.any()), mask

    def exchange(self, *sends: torch.Tensor) -> tuple[list[torch.Tensor], list]:
        """Start sending `sends` to the next rank and receiving the previous rank's tensors of the same shapes, in
        one batch (a tag per tensor, so gloo never pairs one tensor's send with another's receive)."""
        recvs = [torch.empty_like(t) for t in sends]
        ops = []
        for tag, (send, recv) in enumerate(zip(sends, recvs)):
            ops += [dist.P2POp(dist.isend, send, self.next, self.group, tag),
                    dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recvs, dist.batch_isend_irecv(ops)


def _halves(t: torch.Tensor, c: int):
    return t[..., :c, :], t[..., c:, :]


class RingAttention(torch.autograd.Function):
    """q [B, KVH, G, 2c, D], k/v [B, KVH, 2c, D] (this rank's head then tail chunk) -> out like q."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, ring: Ring):
        c, device = ring.chunk, q.device
        mine = ring.chunks(ring.rank)
        qs = _halves(q, c)
        acc: list = [None, None]  # per query chunk: (out, lse)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.world):
            pending = ring.exchange(kv) if step < ring.world - 1 else None
            theirs = ring.chunks((ring.rank - step) % ring.world)
            k_halves, v_halves = _halves(kv[0], c), _halves(kv[1], c)
            for i in range(2):
                for j in range(2):
                    visible, mask = ring.pair_mask(mine[i], theirs[j], device)
                    if not visible:
                        continue
                    o, lse = attention_lse_ref(qs[i], k_halves[j], v_halves[j], scale, mask)
                    acc[i] = (o, lse) if acc[i] is None else merge_lse(*acc[i], o, lse)
            if pending is not None:
                (kv,), reqs = pending
                for r in reqs:
                    r.wait()
        out = torch.cat([acc[0][0], acc[1][0]], dim=-2)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.ring = scale, ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, ring = ctx.scale, ctx.ring
        c, device = ring.chunk, q.device
        mine = ring.chunks(ring.rank)
        qs, outs, lses = _halves(q, c), _halves(out, c), (lse[..., :c], lse[..., c:])
        douts = _halves(dout, c)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros_like(q, dtype=acc_dtype)
        dqs = _halves(dq, c)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv, dtype=acc_dtype)
        for step in range(ring.world):
            theirs = ring.chunks((ring.rank - step) % ring.world)
            for i in range(2):
                for j in range(2):
                    visible, mask = ring.pair_mask(mine[i], theirs[j], device)
                    if not visible:
                        continue
                    keys = slice(j * c, (j + 1) * c)
                    gq, gk, gv = attention_lse_backward_ref(qs[i], kv[0][..., keys, :], kv[1][..., keys, :], scale,
                                                            mask, outs[i], lses[i], douts[i])
                    dqs[i].add_(gq)
                    dkv[0][..., keys, :].add_(gk)
                    dkv[1][..., keys, :].add_(gv)
            # the accumulated dK/dV travel on with their K/V; after the last step one hop takes them home
            received, reqs = ring.exchange(dkv) if step == ring.world - 1 else ring.exchange(dkv, kv)
            for r in reqs:
                r.wait()
            dkv, kv = received[0], (received[1] if len(received) > 1 else kv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


@torch.compiler.disable  # P2P inside an autograd.Function: always eager, also inside a compiled layer
def ring_attention(q, k, v, scale: float, ring: Ring, batch: int) -> torch.Tensor:
    """brrr's attention interface for a context-parallel shard: q [B*2c, H, D], k/v [B*2c, KVH, D] (RoPE already
    applied at the tokens' global positions) -> [B*2c, H*D]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    length, groups = n // batch, heads // kv_heads
    q5 = q.view(batch, length, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).contiguous()
    k4, v4 = (t.view(batch, length, kv_heads, dim).permute(0, 2, 1, 3).contiguous() for t in (k, v))
    out = RingAttention.apply(q5, k4, v4, scale, ring)
    return out.permute(0, 3, 1, 2, 4).reshape(n, heads * dim)
