"""Reference generation: one sequence, a contiguous KV cache, eager model calls.

This is the test oracle the paged engine is checked against; it favours clarity over speed.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from brrr.engine.sampler import SampleRow, sample
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.sampling_params import SamplingParams


def allocate_contiguous_cache(model, capacity: int):
    """Per layer (k, v) of shape [1 block, capacity, kv_heads, head_dim]: the paged layout with one block (MLA: the
    latent row as k, no v; ModelConfig.kv_cache_dims)."""
    cfg, p = model.config, next(model.parameters())
    heads, k_dim, v_dim = cfg.kv_cache_dims
    return [(torch.empty(1, capacity, heads, k_dim, dtype=p.dtype, device=p.device),
             torch.empty(1, capacity, heads, v_dim, dtype=p.dtype, device=p.device)) for _ in range(cfg.num_layers)]


def _step_meta(start: int, n: int, caches, device) -> AttnMeta:
    return AttnMeta(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seqlens_q=[n],
        context_lens=[start + n],
        slot_mapping=torch.arange(start, start + n, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        kv_caches=caches,
    )


@torch.inference_mode()
def generate_tokens(model, prompt_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yields new token ids until max_tokens, a stop/eos token (yielded, then stop) or the context limit."""
    cfg = model.config
    max_pos = cfg.max_context
    if not prompt_ids:
        raise BrrrError("prompt is empty: give at least one token")
    if len(prompt_ids) >= max_pos:
        raise BrrrError(f"prompt has {len(prompt_ids)} tokens; the model's context (max_position_embeddings, scaled by dynamic RoPE) "
                        f"is {max_pos}, which leaves no room to generate")
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise BrrrError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    device = next(model.parameters()).device
    if params.n != 1 or params.stop:
        raise BrrrError("the reference generator takes n=1 and no stop strings; use the engine (brrr.LLM) for those")
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    capacity = min(len(prompt_ids) + params.max_tokens, max_pos)
    caches = allocate_contiguous_cache(model, capacity)
    row = SampleRow(params, params.seed, 0, list(prompt_ids), [], tuple(stop))
    ids = torch.tensor(prompt_ids, device=device)
    pos = 0
    for _ in range(capacity - len(prompt_ids)):
        positions = torch.arange(pos, pos + len(ids), device=device)
        hidden = model(ids, positions, _step_meta(pos, len(ids), caches, device))
        token = sample(model.compute_logits(hidden[-1:]), [row]).tokens[0]
        row.output_ids.append(token)
        row.step += 1
        yield token
        if token in stop:
            return
        pos += len(ids)
        ids = torch.tensor([token], device=device)


@torch.inference_mode()
def forward_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] for every position of one sequence, in one cache-free causal pass."""
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(len(ids), device=device), AttnMeta.causal([len(ids)], device))
    return model.compute_logits(hidden)
