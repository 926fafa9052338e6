"""Tensor-parallel shards of brrr's weight-quantized checkpoints (`brrr quantize`: int8, int4, fp8; W8A16, W4A16,
and the W8A8 variants). Every format's tensors follow the weight's [out, in] orientation, so a rank slices them as
it slices the float weight: column-parallel projections take their output rows of every tensor; row-parallel ones
take their input columns of the codes (int4: two per byte) and of the int4 group scales and zeros, and keep the
per-row scales whole (a row's scale applies to all of its columns). Each rank then builds `QuantLinear`s of its
local shape, so the packed serving modules and the quantized kernels run on the shard unchanged; a row-parallel one
is wrapped to all-reduce its output before the bias.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from brrr.distributed.sharding import FLAG, Collectives, Partition
from brrr.errors import BrrrError
from brrr.quant.checkpoint import FORMAT_TENSORS, quantized_entries
from brrr.quant.linear import QuantLinear, projections

SHARDED_FORMATS = ("int8", "int4", "fp8")
ROW_PARALLEL = ("o_proj", "down_proj")


class RowParallelQuant(nn.Module):
    """A row-parallel projection whose local product is a QuantLinear: all_reduce(q(x_local)) + b."""

    def __init__(self, inner: QuantLinear, bias: bool, comm: Collectives, dtype: torch.dtype, device):
        super().__init__()
        self.inner, self.comm = inner, comm
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.bias = (nn.Parameter(torch.empty(inner.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def partial(self, x):
        """This rank's share of the product (a LoRA update is added to it before the sum)."""
        return self.inner(x)

    def reduce(self, y):
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x):
        return self.reduce(self.partial(x))


def check_quantized(qc: dict, part: Partition) -> None:
    """What of a quantized checkpoint cannot be sharded over N, before anything loads."""
    fmt = qc.get("format")
    if qc.get("quant_method") != "brrr" or fmt not in SHARDED_FORMATS:
        raise BrrrError(f"{FLAG}: quantized checkpoints shard in brrr's own {', '.join(SHARDED_FORMATS)} formats; "
                        f"this one is {qc.get('quant_method')!r} format {fmt!r}")
    if qc.get("lm_head"):
        raise BrrrError(f"{FLAG}: a quantized lm_head is not sharded yet (quantize without --lm-head)")
    group = qc.get("group_size") or 0
    if fmt == "int4":
        for what, width in (("attention output width", part.heads * part.cfg.head_dim),
                            ("intermediate size", part.intermediate)):
            if width % group:
                raise BrrrError(f"{FLAG} = {part.world}: each rank's share of the {what} ({width}) must be a "
                                f"multiple of the int4 group size {group}")


def _slice(view, leaf: str, fmt: str, row_parallel: bool, start: int, stop: int, group: int) -> torch.Tensor:
    shape = view.get_shape()
    if not row_parallel:  # output rows of every tensor; a per-tensor fp8 scale ([1]) is whole
        return view[:] if len(shape) == 1 and shape[0] == 1 else view[start:stop]
    if len(shape) == 1:  # per-row scales
        return view[:]
    if leaf == "qweight":
        return view[:, start // 2: stop // 2] if fmt == "int4" else view[:, start:stop]
    return view[:, start // group: stop // group]  # int4 scales and zeros: [out, in / group]


@torch.no_grad()
def shard_quantized(model, qc: dict, files: list[Path], part: Partition, comm: Collectives, dtype: torch.dtype,
                    device) -> set[str]:
    """Replace each projection of this rank's `model` with its QuantLinear shard built from its slices of the
    checkpoint. Returns the checkpoint names consumed."""
    fmt, group = qc["format"], qc.get("group_size") or 0
    names = FORMAT_TENSORS[fmt]
    targets = dict(projections(model))
    found: dict[str, dict] = {}
    consumed = set()
    for parent, leaf, f, key in quantized_entries(files, names, targets.__contains__):
        row_parallel = parent.rsplit(".", 1)[-1] in ROW_PARALLEL
        _, start, stop = part.slice_of(f"{parent}.weight")
        found.setdefault(parent, {})[leaf] = _slice(f.get_slice(key), leaf, fmt, row_parallel, start, stop, group)
        consumed.add(key)
    for name, linear in targets.items():
        tensors = found.get(name, {})
        missing = [t for t in names if t not in tensors]
        if missing:
            raise BrrrError(f"quantization_config says format {fmt!r}, but {name} lacks tensors {', '.join(missing)}")
        row_parallel = name.rsplit(".", 1)[-1] in ROW_PARALLEL
        has_bias = linear.bias is not None
        bias = None if row_parallel or not has_bias else torch.empty(linear.out_features, dtype=dtype, device=device)
        q = QuantLinear(fmt, {k: t.to(device) for k, t in tensors.items()}, linear.in_features, linear.out_features,
                        bias, dtype=dtype, activations=qc.get("activations"))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, RowParallelQuant(q, has_bias, comm, dtype, device)
                if row_parallel else q)
    return consumed
