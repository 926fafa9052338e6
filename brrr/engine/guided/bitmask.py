"""Token bitmasks: the tokens a grammar allows next, one bit per vocabulary id in llguidance's layout (int32 words;
bit j of word w is token 32 w + j). Filled on the host, one row per guided sequence, then applied to those rows'
logits on the logits' device in one pass for the whole batch."""
from __future__ import annotations

import llguidance
import torch
import torch.nn.functional as F

from brrr.engine.guided.backend import GuidedMatcher
from brrr.kernels.dispatch import use_triton
from brrr.kernels.token_bitmask import apply_token_bitmask_triton

# With few rows the executor's thread hand-off costs more than it saves; from here on the rows are computed in parallel
# (llguidance's threads, outside the GIL).
PARALLEL_ROWS = 8
_EXECUTOR: llguidance.LLExecutor | None = None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[GuidedMatcher], vocab_size: int, pin: bool = False) -> torch.Tensor:
    """The next-token masks of these matchers, [len(matchers), words] int32 on the host (pinned: ready to upload
    without another copy). llguidance computes them outside the GIL."""
    global _EXECUTOR
    mask = torch.empty((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32, pin_memory=pin)
    row_bytes = mask.shape[1] * mask.element_size()
    if len(matchers) >= PARALLEL_ROWS:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                          row_bytes, len(matchers))
    else:
        for i, m in enumerate(matchers):
            m.matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * row_bytes, row_bytes)
    return mask


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each mask byte, the additive bias of its 8 tokens (0 allowed, -inf not)."""
    key = (device, dtype)
    if key not in _BYTE_BIAS:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _BYTE_BIAS[key] = torch.zeros(256, 8, dtype=dtype).masked_fill(bits == 0, float("-inf")).to(device)
    return _BYTE_BIAS[key]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] with the disallowed tokens of `rows` (a device index [G]; None: every row) at -inf; `logits`
    may be modified in place. bitmask: [G, words] int32 on the logits' device. On CUDA, a Triton kernel
    (brrr/kernels/token_bitmask.py). Elsewhere each mask byte looks up its 8 tokens' biases (a gather) and the biases
    are added: on CPU a bool masked_fill over the vocabulary costs several times more."""
    if logits.dtype == torch.float32 and logits.stride(-1) == 1 and use_triton(logits, bitmask):
        return apply_token_bitmask_triton(logits, bitmask, rows)
    vocab = logits.shape[1]
    index = bitmask.view(torch.uint8).to(torch.int32)  # little-endian: byte k of a word holds bits 8k..8k+7
    bias = F.embedding(index, _byte_bias(logits.device, logits.dtype)).view(bitmask.shape[0], -1)[:, :vocab]
    if rows is None:
        return logits + bias
    return logits.index_copy(0, rows, logits.index_select(0, rows) + bias)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """The plain reading of the layout: token t of row i is allowed iff bit t % 32 of word t // 32 is set."""
    out = logits.clone()
    vocab = logits.shape[1]
    tokens = torch.arange(vocab)
    for i, row in enumerate(range(len(logits)) if rows is None else rows):
        allowed = (bitmask[i].cpu().long()[tokens // 32] >> (tokens % 32)) & 1
        out[row] = out[row].masked_fill(allowed.to(out.device) == 0, float("-inf"))
    return out
