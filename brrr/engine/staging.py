"""Host-to-device staging of a step's integer inputs: every array of the step (token ids, positions, cache slots,
query starts, context lengths, block tables, rows to read) packed into one buffer and sent in one pinned,
non-blocking copy (`sampler.h2d`: torch's caching host allocator, the upload stream, never a host wait); the step's
tensors are views of that copy. A pageable copy would wait for the whole stream, and one copy per array would queue
one transfer each. `StepRecord`: a step as the runner's host staging leaves it for the device (on every rank of a
sharded model). `RowInput`: a feature's per-row model input, which the runner stages without knowing what it is."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from brrr.engine.sampler import upload_pinned

# Every array starts 16-byte aligned, as its own allocation would: Triton specializes a pointer argument on 16-byte
# divisibility, so views at other offsets would compile (and autotune) the kernels again inside served steps.
ALIGN = 16
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


@dataclass
class StepRecord:
    """One step as every rank runs it: host arrays and numbers only (rank 0 pickles it to the workers)."""
    kind: str  # "eager" (a varlen forward), "decode" (a decode graph), "verify" (a verify graph)
    arrays: tuple  # staged to the device in one copy, in the kind's order
    copies: np.ndarray | None = None  # [2, n] KV blocks to copy before the step: sources, destinations
    seqlens: list[int] = field(default_factory=list)  # eager: query tokens per row
    context_lens: list[int] = field(default_factory=list)  # eager: context length per row
    size: int = 0  # decode, verify: the captured size replayed
    rows: int = 0  # decode: real rows; eager, verify: rows whose logits are read (sampled first)
    width: int = 0  # decode: block-table width
    longest: int = 0  # decode: longest context (which of the size's graphs)
    want_hidden: bool = False  # verify: the hidden states are read too
    device_ids: bool = False  # some input ids are on rank 0's device only: broadcast from there before the forward
    row_values: np.ndarray | None = None  # the runner's RowInput: each row's value (int32, -1: none)
    row_updates: list = field(default_factory=list)  # its updates, applied on every rank before the step
    # eager: what the runner's attention observer (an eviction policy that scores attention) takes this step
    observe: list = field(default_factory=list)

class RowInput(Protocol):
    """A per-row int input the model reads, from a plug-in feature (LoRA rows: each row's adapter slot). The plan
    gives one value per scheduled item; the runner repeats it over the item's rows (-1 on padding rows and in steps
    the feature is not in), writes them to `buffer` (a graph input: captured graphs keep its address) and brackets
    every forward, captured ones included, with `begin` / `end`. `take_updates` (rank 0, host staging): what the
    feature changed in the model's state since the last step (an adapter loaded into a slot); every rank `apply`s
    each before running the step. `for_workers`: picklable, a tensor-parallel worker's call (model,
    pack_projections) -> (its model, its RowInput)."""
    buffer: torch.Tensor  # [max rows] int32 on the device

    def begin(self, num_rows: int) -> None: ...

    def end(self) -> None: ...

    def take_updates(self) -> list: ...

    def apply(self, update) -> None: ...

    def for_workers(self): ...


def block_copies(copies) -> np.ndarray | None:
    """A step's KV block copies [(src, dst)] as a record carries them: [2, n] int64, None when there are none."""
    return np.array(copies, dtype=np.int64).T.copy() if copies else None


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
    # on CUDA packed straight into pinned memory: no pageable buffer copied into a pinned one
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    packed = host.numpy()
    for a, offset in zip(arrays, offsets):
        packed[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    data = upload_pinned(host, device) if device.type == "cuda" else host
    return [data[offset:offset + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, offset in zip(arrays, offsets)]
