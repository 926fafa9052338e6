"""Host-to-device staging of a step's integer inputs: every array of the step (token ids, positions, cache slots,
query starts, context lengths, block tables, rows to read) packed into one pinned host buffer and sent in one
non_blocking copy on the upload stream; the step's tensors are views of that copy.

The pinned buffers come from torch's caching host allocator, which hands a buffer out again only once the copy
that read it has run, and never makes the host wait for that. A fixed pair of buffers reused in turn had to wait
on the host for the older copy, which took away the pipelined decode's lead over the GPU; a pageable copy waits
for the whole stream."""
from __future__ import annotations

import numpy as np
import torch

from brrr.engine.sampler import copy_stream

# Every array starts 16-byte aligned, as its own allocation would: Triton specializes a pointer argument on 16-byte
# divisibility, so views at other offsets would compile (and autotune) the kernels again inside served steps.
ALIGN = 16
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class InputStaging:
    def __init__(self, device: torch.device):
        self.device = device

    def stage(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Each array (int64 or int32) as a device tensor of its dtype and shape, all from one copy."""
        offsets, total = [], 0
        for a in arrays:
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += a.nbytes
        packed = np.zeros(total, dtype=np.uint8)
        for a, offset in zip(arrays, offsets):
            packed[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        data = self._upload(torch.from_numpy(packed))
        return [data[offset:offset + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape)
                for a, offset in zip(arrays, offsets)]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host
        up = copy_stream("up", self.device)
        if up is None:  # inside a graph capture: on the capturing stream
            return host.pin_memory().to(self.device, non_blocking=True)
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(up):  # it runs at once; the compute stream waits only for it
            out = host.pin_memory().to(self.device, non_blocking=True)
        main.wait_stream(up)
        out.record_stream(main)  # allocated on the upload stream, used on the compute stream
        return out
