"""Grammar token masks on the logits: every token whose bit is clear gets -inf, in place, in one pass. The layout is
llguidance's (int32 words; bit j of word w is token 32 w + j). On the GPU a gather of per-byte biases (the CPU
path, brrr/engine/guided/bitmask.py) writes and re-reads a bias as large as the logits; this kernel reads each
mask word once per 32 tokens and stores only the disallowed tokens."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

BLOCK = 4096  # tokens per program: 128 mask words

if triton is not None:
    @triton.jit
    def _apply_token_bitmask_kernel(L, M, ROWS, vocab, l_stride, m_stride, HAS_ROWS: tl.constexpr,
                                    BLOCK: tl.constexpr):
        """Program (g, b): tokens [b * BLOCK, (b + 1) * BLOCK) of mask row g, applied to logits row ROWS[g] (g)."""
        g, b = tl.program_id(0), tl.program_id(1)
        row = tl.load(ROWS + g).to(tl.int64) if HAS_ROWS else g.to(tl.int64)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        words = tl.load(M + g.to(tl.int64) * m_stride + cols // 32, mask=inside, other=-1)
        banned = ((words >> (cols % 32)) & 1) == 0
        tl.store(L + row * l_stride + cols, tl.full([BLOCK], float("-inf"), tl.float32), mask=inside & banned)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 (last dim contiguous), bitmask [G, words] int32 on the same device, rows [G] (None: G = B):
    the banned tokens of those rows set to -inf in place. Returns logits."""
    groups = bitmask.shape[0]
    if groups == 0:
        return logits
    bitmask = bitmask.contiguous()
    grid = (groups, triton.cdiv(logits.shape[1], BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows if rows is not None else bitmask, logits.shape[1],
                                      logits.stride(0), bitmask.stride(0), HAS_ROWS=rows is not None, BLOCK=BLOCK,
                                      num_warps=4)
    return logits
