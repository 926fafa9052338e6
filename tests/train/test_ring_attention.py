"""Ring attention (brrr/train/parallel/ring_attention.py) on 3 gloo processes against full causal attention
on one process (brrr's reference, autograd): the forward and the gradients of q, k and v, head-tail sharded, on
uneven shapes (GQA, an odd chunk length, a head dim that is no power of two, a sliding window); the cp loss
module's sums, means and gradients against the one-process loss (a padded length, an ignored target). Also the
one-block log-sum-exp op against SDPA, and the shard positions."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from brrr.kernels import AttnMeta
from brrr.kernels.attention.lse import attention_lse_backward_ref, attention_lse_ref, merge_lse
from brrr.kernels.attention.reference import attention_ref
from brrr.train.parallel.context_parallel import shard_positions
from tests.train.distributed_helpers import free_port

# (batch, chunk c, heads, kv heads, head dim, sliding window)
SHAPES = [(2, 5, 4, 2, 12, None), (1, 3, 3, 1, 8, None), (2, 4, 2, 2, 6, 7)]


def _full(batch, length, heads, kv_heads, dim, window, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch * length, h, dim, generator=g, dtype=torch.float64)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(batch * length, heads * dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _ring_worker(rank, world, port, shapes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from brrr.train.parallel.ring_attention import Ring, ring_attention

    try:
        for n, (batch, c, heads, kv_heads, dim, window) in enumerate(shapes):
            length = 2 * world * c
            q, k, v, dout = _full(batch, length, heads, kv_heads, dim, window, seed=n)
            scale = dim**-0.5
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = attention_ref(*leaves, AttnMeta.causal([length] * batch, "cpu"), 0, scale, window)
            ref.backward(dout)
            pos = shard_positions(length, world, rank)
            rows = (torch.arange(batch)[:, None] * length + pos[None, :]).reshape(-1)
            mine = [t[rows].clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*mine, scale, Ring(dist.group.WORLD, c, window), batch)
            out.backward(dout[rows])
            torch.testing.assert_close(out, ref[rows], rtol=1e-9, atol=1e-10)
            for got, want in zip(mine, leaves):
                torch.testing.assert_close(got.grad, want.grad[rows], rtol=1e-9, atol=1e-10)
        _loss_over_the_ring(world)
    finally:
        dist.destroy_process_group()


def _loss_over_the_ring(world):
    """The loss module of a cp rank: summed over the ranks it is the full sum (a length 2 x world does not divide,
    padded); the "mean" shares average to the full mean and their gradients, averaged as FSDP does, to its
    gradients."""
    from brrr.config import ModelConfig
    from brrr.train.loss import CausalLMLoss
    from brrr.train.parallel.context_parallel import ContextParallelLoss
    from brrr.train.pretrain import build_model
    from tests.train.conftest import TINY_MODEL

    model = build_model(ModelConfig.from_hf({**TINY_MODEL, "vocab_size": 50}), "cpu").double()
    g = torch.Generator().manual_seed(7)
    inputs, targets = torch.randint(0, 50, (2, 29), generator=g), torch.randint(0, 50, (2, 29), generator=g)
    targets[1, 3] = -100  # an ignored target: the mean counts only the others
    full, ring = CausalLMLoss(model), ContextParallelLoss(model, dist.group.WORLD)
    with torch.no_grad():
        total = ring(inputs, targets, reduction="sum")
        dist.all_reduce(total)
        # the chunked loss takes its log-sum-exp in fp32 whatever the model's dtype: fp32 tolerances from here
        torch.testing.assert_close(total, full(inputs, targets, reduction="sum"), rtol=1e-6, atol=0)
    share = ring(inputs, targets)
    share.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = full(inputs, targets)
    whole.backward()
    mean = share.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / world, whole.detach(), rtol=1e-6, atol=0)
    for got, p in zip(grads, model.parameters()):
        dist.all_reduce(got)
        torch.testing.assert_close(got / world, p.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("world", [3])  # 3: next and previous rank differ (2 ranks train in test_context_parallel.py)
def test_ring_attention_equals_full_causal_attention_forward_and_backward(world):
    mp.start_processes(_ring_worker, args=(world, free_port(), SHAPES), nprocs=world, start_method="fork")


def test_block_lse_merges_to_sdpa_and_its_backward_is_autograds():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)  # [B, KVH, G, Tq, D]
    k, v = (torch.randn(2, 2, 9, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(7, 9, generator=g) > 0.3
    mask[:, 0] = True
    out, lse = attention_lse_ref(q, k, v, 0.4, mask)
    # two disjoint key blocks merged equal the whole
    a, b = attention_lse_ref(q, k[:, :, :4], v[:, :, :4], 0.4, mask[:, :4]), \
        attention_lse_ref(q, k[:, :, 4:], v[:, :, 4:], 0.4, mask[:, 4:])
    merged, merged_lse = merge_lse(*a, *b)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.flatten(1, 2), k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.4)
    torch.testing.assert_close(out.flatten(1, 2), sdpa)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = attention_lse_backward_ref(q.detach(), k.detach(), v.detach(), 0.4, mask, out.detach(),
                                            lse.detach(), dout)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want)


def test_head_tail_shards_cover_the_sequence_once_with_equal_causal_work():
    n, length = 4, 32
    shards = [shard_positions(length, n, r) for r in range(n)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(length))
    assert shards[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]  # chunks 1 and 6 of 8
    work = [int((s[:, None] >= torch.arange(length)[None, :]).sum()) for s in shards]  # visible (q, k) pairs
    assert len(set(work)) == 1
