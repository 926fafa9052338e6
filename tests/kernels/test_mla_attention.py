"""MLA over the paged latent cache (absorbed decode, prefill expanded from latents) against the expanded attention
over an expanded paged cache: one mixed step of decodes and prefill chunks, blocks scattered through the cache."""
import torch

from brrr.kernels import AttnMeta
from brrr.kernels.attention import attention_ref
from brrr.kernels.mla_attention import mla_attention, write_latent_ref

H, NOPE, ROPE, V, R, BS = 4, 16, 8, 12, 32, 4


def test_latent_cache_attention_equals_expanded_attention():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(H, NOPE + V, R, generator=gen) * 0.2
    w_kb, w_vb = w[:, :NOPE], w[:, NOPE:]
    seqlens_q, context = [1, 5, 1, 3], [9, 5, 14, 11]  # decodes and prefill chunks (one with a cached prefix)
    blocks_per = [-(-c // BS) for c in context]
    perm = torch.randperm(sum(blocks_per) + 3, generator=gen)  # scattered blocks
    tables = torch.zeros(len(context), max(blocks_per), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(blocks_per):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    num_blocks = len(perm)
    latent = torch.full((num_blocks, BS, 1, R + ROPE), float("nan"))  # unwritten slots must never be read
    k_cache, v_cache = torch.zeros(num_blocks, BS, H, NOPE + ROPE), torch.zeros(num_blocks, BS, H, NOPE + ROPE)
    # every context token's latent row; the cached prefix goes in first, the new tokens through the step
    c_all = [torch.randn(n, R, generator=gen) for n in context]
    kr_all = [torch.randn(n, ROPE, generator=gen) for n in context]
    slots_all = [tables[b, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS for b, n in enumerate(context)]

    def expanded(c, kr):
        kn = torch.einsum("tr,hdr->thd", c, w_kb)
        return torch.cat((kn, kr[:, None].expand(-1, H, -1)), -1), torch.nn.functional.pad(
            torch.einsum("tr,hvr->thv", c, w_vb), (0, NOPE + ROPE - V))

    new_c, new_kr, new_slots = [], [], []
    for b, q in enumerate(seqlens_q):
        old = context[b] - q
        write_latent_ref(c_all[b][:old], kr_all[b][:old], latent, slots_all[b][:old])
        k, v = expanded(c_all[b][:old], kr_all[b][:old])
        k_cache.view(-1, H, NOPE + ROPE)[slots_all[b][:old]] = k
        v_cache.view(-1, H, NOPE + ROPE)[slots_all[b][:old]] = v
        new_c.append(c_all[b][old:]), new_kr.append(kr_all[b][old:]), new_slots.append(slots_all[b][old:])
    c, kr, slots = torch.cat(new_c), torch.cat(new_kr), torch.cat(new_slots)
    n = c.shape[0]
    q_nope, q_rope = torch.randn(n, H, NOPE, generator=gen), torch.randn(n, H, ROPE, generator=gen)
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    scale = 0.3

    meta = AttnMeta(cu, seqlens_q, context, slots, tables, [(latent, latent[..., :0])])
    write_latent_ref(c, kr, latent, slots)
    got = mla_attention(q_nope, q_rope, latent, meta, w_kb, w_vb, scale)

    k, v = expanded(c, kr)
    ref_meta = AttnMeta(cu, seqlens_q, context, slots, tables, [(k_cache, v_cache)])
    ref = attention_ref(torch.cat((q_nope, q_rope), -1), k, v, ref_meta, 0, scale).view(n, H, -1)[..., :V]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

    # all decodes: the vectorised absorbed path (what a captured decode graph runs, device-only meta)
    rows = [0, 2]
    dec_meta = AttnMeta(torch.arange(3, dtype=torch.int32), [1, 1], None, None, tables[rows], [(latent, latent[..., :0])],
                        context_lens_t=torch.tensor([context[0], context[2]], dtype=torch.int32))
    starts = cu[:-1].tolist()
    idx = [starts[r] for r in rows]
    got_dec = mla_attention(q_nope[idx], q_rope[idx], latent, dec_meta, w_kb, w_vb, scale)
    torch.testing.assert_close(got_dec, ref[idx], atol=1e-5, rtol=1e-5)
