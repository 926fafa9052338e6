"""Per-token log-probabilities of given tokens under a model: what DPO's sequence scores and GRPO's importance
ratios are made of.

A varlen batch (flat ids, positions, `AttnMeta.causal` over the sequences) goes through the model once; only the
rows that predict a scored token (targets != IGNORE) reach the LM head, `chunk` rows at a time, each chunk's fp32
log-softmax recomputed in backward when gradients are on, so only one chunk's logits ever exist. `temperature`
divides the logits first (GRPO scores tokens under the distribution they were sampled from, as TRL does). The
log-softmax is the engine sampler's (`brrr.kernels.log_softmax`, row-invariant), so inside `batch_invariant()` a
trainer's log-probs are the engine's bit for bit; the backward's recomputation then runs in the mode too.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint as recompute
from torch.utils.checkpoint import noop_context_fn

from brrr.kernels.batch_invariant import batch_invariant, batch_invariant_on
from brrr.kernels.log_softmax import log_softmax
from brrr.train.sft import IGNORE

CHUNK = 256  # rows of logits per LM-head call


def _chunk_logprobs(model, hidden, targets, temperature: float):
    logits = model.compute_logits(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return log_softmax(logits).gather(1, targets[:, None]).squeeze(1)


def _in_the_mode():
    """checkpoint's (forward, recompute) contexts: the recompute in backward runs in the mode the forward ran in."""
    return contextlib.nullcontext(), batch_invariant()


def token_logprobs(model, ids, targets, positions, meta, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [K], rows [K]): the log-probability of targets[rows] at each row where a target is set (rows in
    increasing order). Gradients flow to the model when they are enabled."""
    hidden = model(ids, positions, meta)
    rows = (targets != IGNORE).nonzero().squeeze(1)
    hidden, wanted = hidden.index_select(0, rows), targets.index_select(0, rows)
    out = []
    contexts = _in_the_mode if batch_invariant_on() else noop_context_fn
    for h, t in zip(hidden.split(CHUNK), wanted.split(CHUNK)):
        if torch.is_grad_enabled():
            out.append(recompute(_chunk_logprobs, model, h, t, temperature, use_reentrant=False,
                                 context_fn=contexts))
        else:
            out.append(_chunk_logprobs(model, h, t, temperature))
    return (torch.cat(out) if out else hidden.sum(-1)), rows


def segment_of(lengths: list[int], device) -> torch.Tensor:
    """The sequence index of every flat row of a varlen batch of these lengths."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.as_tensor(lengths, device=device))


def sequence_sums(values: torch.Tensor, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-sequence sums [len(lengths)] of values given at flat rows (token_logprobs' output)."""
    seg = segment_of(lengths, rows.device).index_select(0, rows)
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, seg, values)
