"""Load one rank's shard: the model at its local sizes (sharding.build_shard) filled with its slices of the
checkpoint, read through `get_slice` on the memory-mapped safetensors, so no rank reads what it does not hold;
quantized projections through quant_sharding.py."""
from __future__ import annotations

from pathlib import Path

import torch

from brrr.distributed.quant_sharding import shard_quantized
from brrr.distributed.sharding import Collectives, Partition, build_shard
from brrr.errors import BrrrError
from brrr.loader import checkpoint_entries
from brrr.quant.checkpoint import quantization_config


@torch.no_grad()
def load_shard(path: Path | None, files: list[Path], part: Partition, comm: Collectives, dtype: torch.dtype,
               device: torch.device):
    """Build this rank's model and fill it from the checkpoint, reading only its slices; path None: random weights
    of the config's shape (benchmarks, as `brrr.models.random_weights`), seeded per rank."""
    model = build_shard(part, comm, dtype, device)
    if path is None:
        from brrr.models.random_weights import randomize

        return randomize(model, seed=part.rank).requires_grad_(False).eval()
    qc = quantization_config(path)
    skip = shard_quantized(model, qc, files, part, comm, dtype, device) if qc else set()
    filled: set[str] = set()
    for file in files:
        for name, target, f in checkpoint_entries(model, file, skip):
            where, view = part.slice_of(name), f.get_slice(name)
            if where is None:
                tensor = view[:]
            else:
                dim, start, stop = where
                stop = max(start, min(stop, view.get_shape()[dim]))  # the vocabulary's padding rows stay zero
                tensor = view[start:stop] if dim == 0 else view[:, start:stop]
                if dim == 0 and stop - start < target.shape[0]:
                    target[stop - start:].zero_()
            dest = target[: tensor.shape[0]] if where is not None and where[0] == 0 else target
            if dest.shape != tensor.shape:
                raise BrrrError(f"{file}: tensor {name!r} slice has shape {tuple(tensor.shape)}, rank "
                                f"{part.rank} of {part.world} expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(name)
    missing = sorted(n for n, _ in model.checkpoint_tensors() if n not in filled)
    if missing:
        raise BrrrError(f"checkpoint in {path} is missing tensors: {', '.join(missing[:5])}")
    return model.requires_grad_(False).eval()
