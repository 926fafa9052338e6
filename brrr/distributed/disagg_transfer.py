"""Moving a prompt's KV blocks from a prefill instance's paged cache to the decode instance's.

Each prefill instance and the decode instance share a two-rank process group of their own (decode rank 0, prefill
rank 1; gloo on CPU, NCCL on CUDA), so a prefill instance that dies breaks only its own channel. A transfer is one
point-to-point message: the sender gathers the request's blocks from every layer's K and V into one contiguous
buffer [layers, 2, blocks, block_size, kv_heads, head_dim] and sends it; the receiver receives it whole and
scatters it into the blocks its own block manager allocated (other ids than the sender's). Both ends run the
transfer on a thread of their own (and on CUDA a stream of their own), so neither instance's steps wait for it.
"""
from __future__ import annotations

import datetime

import torch

# Longest a receive (or send) may take before the channel counts as broken and its prefill instance is stopped: a
# hung peer never hangs the decode instance.
KV_TRANSFER_TIMEOUT_S = 30.0
TIMEOUT = datetime.timedelta(seconds=KV_TRANSFER_TIMEOUT_S)
DECODE_RANK, PREFILL_RANK = 0, 1


def kv_shape(kv_caches, num_blocks: int) -> tuple[int, ...]:
    """The transfer buffer's shape for `num_blocks` blocks of these caches."""
    return (len(kv_caches), 2, num_blocks) + tuple(kv_caches[0][0].shape[1:])


def gather_blocks(kv_caches, block_ids: list[int]) -> torch.Tensor:
    """Blocks `block_ids` of every layer's K and V, copied into one contiguous buffer."""
    k0 = kv_caches[0][0]
    index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    out = torch.empty(kv_shape(kv_caches, len(block_ids)), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        torch.index_select(k, 0, index, out=out[layer, 0])
        torch.index_select(v, 0, index, out=out[layer, 1])
    return out


def scatter_blocks(kv_caches, block_ids: list[int], buf: torch.Tensor) -> None:
    """Write a received buffer into blocks `block_ids` of every layer's K and V."""
    index = torch.tensor(block_ids, dtype=torch.long, device=buf.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, buf[layer, 0])
        v.index_copy_(0, index, buf[layer, 1])


def send_kv(group, buf: torch.Tensor) -> None:
    """Send one transfer to the decode instance; returns once it is delivered (or raises after the timeout)."""
    group.send([buf], DECODE_RANK, 0).wait(TIMEOUT)
    if buf.is_cuda:  # delivered, not only queued, before the caller frees the blocks
        torch.cuda.current_stream(buf.device).synchronize()


def receive_kv(group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive one transfer from the prefill instance; raises if it breaks (gloo: the peer's socket closed) or takes
    longer than the timeout."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    group.recv([buf], PREFILL_RANK, 0).wait(TIMEOUT)
    if buf.is_cuda:  # in place before the engine's thread scatters it (on its own stream)
        torch.cuda.current_stream(buf.device).synchronize()
    return buf


def transfer_stream(device: torch.device):
    """A stream of its own for a transfer thread on CUDA (NCCL's wait orders the current stream after the transfer:
    on the default stream it would hold back the instance's own steps); a no-op context on CPU."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    torch.cuda.set_device(device)  # per thread: NCCL and the allocator use the thread's current device
    return torch.cuda.stream(torch.cuda.Stream(device))
