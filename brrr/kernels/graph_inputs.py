"""A decode step's inputs for its captured graph in one launch. The host stages every row in one pinned buffer
(one copy to the device); this scatters it into the graph's static buffers, which took eight small kernels
(copies, zero fills, a gather) between two replays.

Staged layout, int64: ids, positions, cache slots, context lengths (g rows each, padding rows included), then the
b real rows' block tables, `width` wide. The tables land zero-padded to the static buffer's width; with ids_from
(the previous step's tokens on the device and the rows to take) the first b ids are gathered from them, the padded
rows' ids are 0."""
from __future__ import annotations

import torch

from brrr.kernels.dispatch import use_triton


def stage_decode_inputs_ref(stage, g, b, width, ids, pos, slots, ctx, tables, ids_from=None):
    if ids_from is None:
        ids[:g].copy_(stage[:g])
    else:
        ids[:g].zero_()
        ids[:b].copy_(ids_from[0].index_select(0, ids_from[1]))
    pos[:g].copy_(stage[g:2 * g])
    slots[:g].copy_(stage[2 * g:3 * g])
    ctx[:g].copy_(stage[3 * g:4 * g])
    tables[:g].zero_()
    tables[:b, :width].copy_(stage[4 * g:].view(b, width))


try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    # no int specialization: a width or batch that became 1 or a multiple of 16 mid-run must not compile again
    @triton.jit(do_not_specialize=["g", "b", "width", "n_cols"])
    def _stage_kernel(STAGE, SRC, IDX, IDS, POS, SLOTS, CTX, TABLES, g, b, width, n_cols, stride_t,
                      FROM_SRC: tl.constexpr, BLOCK_W: tl.constexpr):
        r = tl.program_id(0)
        real = r < b
        if FROM_SRC:  # a padded row reads the last real row's token and stores 0
            tok = tl.where(real, tl.load(SRC + tl.load(IDX + tl.minimum(r, b - 1))), 0)
        else:
            tok = tl.load(STAGE + r)
        tl.store(IDS + r, tok.to(IDS.dtype.element_ty))
        tl.store(POS + r, tl.load(STAGE + g + r))
        tl.store(SLOTS + r, tl.load(STAGE + 2 * g + r))
        tl.store(CTX + r, tl.load(STAGE + 3 * g + r).to(CTX.dtype.element_ty))
        row = STAGE + 4 * g + r.to(tl.int64) * width
        for c in range(0, n_cols, BLOCK_W):
            cols = c + tl.arange(0, BLOCK_W)
            v = tl.load(row + cols, mask=(cols < width) & (cols * 0 + r < b), other=0)  # r < b as a vector
            tl.store(TABLES + r.to(tl.int64) * stride_t + cols, v.to(TABLES.dtype.element_ty), mask=cols < n_cols)


def stage_decode_inputs_triton(stage, g, b, width, ids, pos, slots, ctx, tables, ids_from=None):
    src, idx = ids_from if ids_from is not None else (stage, stage)
    _stage_kernel[(g,)](stage, src, idx, ids, pos, slots, ctx, tables, g, b, width, tables.shape[1],
                        tables.stride(0), FROM_SRC=ids_from is not None, BLOCK_W=128, num_warps=1)


def stage_decode_inputs(stage: torch.Tensor, g: int, b: int, width: int, ids, pos, slots, ctx, tables,
                        ids_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write the first g rows of the static buffers from `stage` (layout above)."""
    if triton is not None and use_triton(stage, ids, tables):
        stage_decode_inputs_triton(stage, g, b, width, ids, pos, slots, ctx, tables, ids_from)
    else:
        stage_decode_inputs_ref(stage, g, b, width, ids, pos, slots, ctx, tables, ids_from)
