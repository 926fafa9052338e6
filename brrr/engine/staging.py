"""Host-to-device staging of a step's integer inputs: every array of the step (token ids, positions, cache slots,
query starts, context lengths, block tables, rows to read) packed into one buffer and sent in one pinned,
non-blocking copy (`sampler.h2d`: torch's caching host allocator, the upload stream, never a host wait); the step's
tensors are views of that copy. A pageable copy would wait for the whole stream, and one copy per array would queue
one transfer each."""
from __future__ import annotations

import numpy as np
import torch

from brrr.engine.sampler import h2d

# Every array starts 16-byte aligned, as its own allocation would: Triton specializes a pointer argument on 16-byte
# divisibility, so views at other offsets would compile (and autotune) the kernels again inside served steps.
ALIGN = 16
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def pad_tables(tables: np.ndarray) -> np.ndarray:
    """Block tables widened to a multiple of 16 columns. Triton specializes an int argument on divisibility by 16: a
    table width (the kernels' row stride) that became one mid-run compiled the attention kernels again inside a
    served step. Always one: no new variant."""
    return np.pad(tables, ((0, 0), (0, -tables.shape[1] % 16)))


def index_in_row(lengths) -> np.ndarray:
    """For rows of the given lengths laid end to end, each element's index within its row: 0 .. n_0 - 1, 0 .. n_1 - 1,
    and so on."""
    n = np.asarray(lengths)
    return np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)


def stage(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Each array (int64 or int32) as a tensor on `device` of its dtype and shape, all from one copy."""
    offsets, total = [], 0
    for a in arrays:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += a.nbytes
    packed = np.zeros(total, dtype=np.uint8)
    for a, offset in zip(arrays, offsets):
        packed[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    data = h2d(torch.from_numpy(packed), device)
    return [data[offset:offset + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, offset in zip(arrays, offsets)]
