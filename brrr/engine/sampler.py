"""The sampler: penalties -> min_tokens mask -> temperature -> top-k -> top-p -> min-p -> draw.

Draws use the exponential race (argmax of p / E with E ~ Exp(1), equivalent to sampling from p). A seeded request
draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brrr.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # masked while len(output_ids) < min_tokens


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {token: logprob} for the sampled token and the top-k


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts[: logits.shape[-1]] + p.presence_penalty * (counts[: logits.shape[-1]] > 0)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] already divided by temperature; top_k [B] (0 = off), top_p/min_p [B]. Masked -> -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]  # keep the smallest head whose mass reaches top_p (always the first)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """logits [B, V] fp32 (one row per SampleRow) -> one token per row."""
    device = logits.device
    want_logprobs = [r.params.logprobs for r in rows]
    raw_logprobs = logits.log_softmax(-1) if any(k is not None for k in want_logprobs) else None
    if any(r.params.has_penalties or len(r.output_ids) < r.params.min_tokens for r in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            apply_penalties(logits[i], row)
            if len(row.output_ids) < row.params.min_tokens and row.stop_ids:
                logits[i, list(row.stop_ids)] = float("-inf")
    greedy_rows = [r.params.greedy for r in rows]
    tokens = logits.argmax(-1)
    if not all(greedy_rows):  # decided on the host: no device sync before the one .tolist() below
        greedy = torch.tensor(greedy_rows, device=device)
        temp = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device, dtype=logits.dtype)
        top_k = torch.tensor([r.params.top_k for r in rows], device=device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device, dtype=logits.dtype)
        min_p = torch.tensor([r.params.min_p for r in rows], device=device, dtype=logits.dtype)
        probs = filter_logits(logits / temp[:, None], top_k, top_p, min_p).softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        tokens = torch.where(greedy, tokens, (probs / noise).argmax(-1))
    token_list = tokens.tolist()
    out_logprobs = []
    for i, k in enumerate(want_logprobs):
        if k is None:
            out_logprobs.append(None)
            continue
        entry = {token_list[i]: float(raw_logprobs[i, token_list[i]])}
        if k:
            top = raw_logprobs[i].topk(k)
            entry.update(zip(top.indices.tolist(), top.values.tolist()))
        out_logprobs.append(entry)
    return SampleResult(token_list, out_logprobs)
