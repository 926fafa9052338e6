"""Prompt + completion sequences as one varlen batch, and their completions' per-token values as [B, T] padded rows
(what GRPO's loss reads, as TRL lays out completion_ids / completion_mask)."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from brrr.kernels import AttnMeta
from brrr.train.logprobs import token_logprobs
from brrr.train.sft import IGNORE


def completion_batch(prompts: list[list[int]], completions: list[list[int]], device) -> tuple:
    """(ids [N], targets [N], positions [N], AttnMeta) of the sequences prompt_i + completion_i: targets are the
    completion tokens (each predicted by the token before it), IGNORE elsewhere."""
    ids, targets, positions, lengths = [], [], [], []
    for p, c in zip(prompts, completions):
        ids += p + c
        targets += [IGNORE] * (len(p) - 1) + c + [IGNORE]
        positions += range(len(p) + len(c))
        lengths.append(len(p) + len(c))
    out = [torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device) for a in (ids, targets, positions)]
    return (*out, AttnMeta.causal(lengths, device))


def padded(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Flat per-completion-token values (sequence by sequence) -> [B, max(counts)], zeros past each end."""
    return pad_sequence(list(values.split(counts)), batch_first=True)


def completion_mask(counts: list[int], device) -> torch.Tensor:
    width = max(counts) if counts else 0
    return (torch.arange(width, device=device)[None, :] < torch.as_tensor(counts, device=device)[:, None]).float()


def completion_logprobs(model, prompts, completions, device, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log-probs of each completion's tokens under the model (gradients when enabled)."""
    ids, targets, positions, meta = completion_batch(prompts, completions, device)
    logps, _ = token_logprobs(model, ids, targets, positions, meta, temperature)
    return padded(logps, [len(c) for c in completions])
