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
