"""Sliding-window perplexity: windows of `window` tokens every `stride`; each window scores only the tokens the
previous one did not (the first window scores all but its first token), so every token after the first is scored
exactly once, with at least window - stride tokens of context after the first window. Same tokens, same windows
for every model."""
from __future__ import annotations

import math

import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.progress import progress


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over n_tokens. stride < window, so every scored token
    has at least one token of context inside its window (at least window - stride after the first window)."""
    if not 0 < stride < window:
        raise BrrrError(f"--stride must be in [1, --window - 1 = {window - 1}]; got {stride}")
    if n_tokens < 2:
        raise BrrrError(f"perplexity needs at least 2 tokens; got {n_tokens}")
    end = min(window, n_tokens)
    out = [(0, end, 1)]
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        out.append((max(0, new_end - window), new_end, end))
        end = new_end
    return out


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, window: int = 512, stride: int = 256, batch: int = 8,
               progress_label: str | None = None) -> dict:
    """{'ppl', 'nll', 'tokens'} of `tokens` (1-D) under `model`. progress_label: a bar on stderr with this label."""
    max_pos = model.config.max_position_embeddings
    if window > max_pos:
        raise BrrrError(f"--window {window} exceeds the model's max_position_embeddings {max_pos}")
    device = next(model.parameters()).device
    spans = windows(len(tokens), window, stride)
    total, count = 0.0, 0
    with progress(progress_label or "", len(spans), progress_label is not None) as advance:
        for i in range(0, len(spans), batch):
            group = spans[i:i + batch]
            total_i, count_i = _score(model, tokens, group, device)
            total, count = total + total_i, count + count_i
            advance(len(group))
    return {"ppl": math.exp(total / count), "nll": total / count, "tokens": count}


def _score(model, tokens, group, device) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens scored) of one batch of windows."""
    ids = torch.cat([tokens[b:e] for b, e, _ in group]).to(device)
    positions = torch.cat([torch.arange(e - b) for b, e, _ in group]).to(device)
    hidden = model(ids, positions, AttnMeta.causal([e - b for b, e, _ in group], device))
    total, count, offset = 0.0, 0, 0
    for b, e, first in group:
        # hidden row r predicts token b + r + 1; score targets first..e-1
        rows = hidden[offset + first - b - 1: offset + e - b - 1]
        logits = model.compute_logits(rows)
        target = tokens[first:e].to(device)
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += e - first
        offset += e - b
    return total, count
