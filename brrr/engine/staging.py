"""Host-to-device staging of a step's integer inputs: every array of the step (token ids, positions, cache slots,
query starts, context lengths, block tables, rows to read) packed into one persistent pinned host buffer and sent
in one non_blocking copy; the step's tensors are views of that copy. A pageable copy would make the host wait for
the GPU, and one copy per array would queue one transfer each."""
from __future__ import annotations

import numpy as np
import torch

from brrr.engine.sampler import copy_stream

ALIGN = 8  # every array starts 8-byte aligned, so int64 and int32 views of the device bytes are valid
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class InputStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        # Two buffers, used in turn: filling one never waits for the copy out of the other (usually long done).
        self._host = [self._new(capacity), self._new(capacity)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def stage(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Each array (int64 or int32) as a device tensor of its dtype and shape, all from one copy."""
        offsets, total = [], 0
        for a in arrays:
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += a.nbytes
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its previous copy has been read out
        if self._host[turn].numel() < total:
            self._host[turn] = self._new(max(total, 2 * self._host[turn].numel()))
        host = self._host[turn]
        view = host.numpy()
        for a, offset in zip(arrays, offsets):
            view[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        data = self._upload(host[:total], turn)
        return [data[offset:offset + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape)
                for a, offset in zip(arrays, offsets)]

    def _upload(self, host: torch.Tensor, turn: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return host.clone()  # the host buffer is reused next step
        event = self._copied[turn] or torch.cuda.Event()  # re-recorded each time its buffer is used
        up = copy_stream("up", self.device)
        if up is None:  # inside a graph capture: on the capturing stream
            out = host.to(self.device, non_blocking=True)
            event.record()
        else:  # on the upload stream: it runs at once, and the compute stream waits only for it
            main = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(up):
                out = host.to(self.device, non_blocking=True)
                event.record(up)
            main.wait_stream(up)
            out.record_stream(main)  # allocated on the upload stream, used on the compute stream
        self._copied[turn] = event
        return out
