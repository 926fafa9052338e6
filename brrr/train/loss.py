"""Next-token cross-entropy straight from the final hidden states and the LM head's weight, a chunk of tokens at a
time, so the [tokens, vocab] logits never exist whole (the "fused linear cross-entropy" of Liger-Kernel, in plain
torch). Chunks are brrr.analysis.train.loss_chunk_rows tokens (1024 at a 128k vocabulary), which `brrr calc train`
counts.

For each chunk of rows the forward computes the chunk's logits in the weight's dtype, upcasts them to fp32, takes
the loss and, while the logits are at hand, the loss's gradients: dlogits = (softmax - onehot) x the reduction's
scale, cast back to the weight's dtype, then dhidden = dlogits @ W (the chunk's rows) and dW += dlogits^T @ hidden.
Backward only multiplies those stored gradients by the incoming scalar. On CUDA the step from a chunk's logits to
its loss and dlogits is compiled (inductor fuses it), so transient memory is one chunk's logits and dlogits in the
weight's dtype, instead of the eager path's bf16 logits, their fp32 copy, the log-softmax and the gradients of
each; the LM-head matmuls are the eager path's three (none recomputed).

The numbers are the eager `F.cross_entropy(lm_head(hidden).float(), targets)`'s: the same bf16 products, the
same fp32 log-sum-exp, the same rounding of dlogits to bf16 before the two gradient matmuls; dW's chunks are summed
in the weight's dtype (one rounding per chunk where the eager matmul rounds once).

`CausalLMLoss` (brrr train) and the pipeline's last stage use it wherever the LM head is a plain bias-free Linear
whose weight is a whole tensor on this rank (one process, DDP, FSDP2 after the root's forward has gathered it).
A vocabulary-sharded head (TP: a DTensor weight) keeps the logits path under `loss_parallel`; fp16 too, whose
dlogits must carry the dynamic loss scale before they are rounded to fp16, and only backward knows it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brrr.analysis.train import loss_chunk_rows
from brrr.kernels import AttnMeta

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it add no loss (padded rows)


def chunk_loss_and_dlogits(logits, targets, valid, scale, grad: bool):
    """One chunk's summed loss over its valid rows and, with grad, d(loss)/d(logits) in the logits' dtype:
    (softmax - onehot) x scale on valid rows, zero on ignored ones. Only pointwise ops and row reductions, so on CUDA
    (compiled) inductor fuses them into a pass or two over the bf16 logits: the fp32 logits are never stored."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=1)
    loss = torch.where(valid, lse - z.gather(1, targets.unsqueeze(1)).squeeze(1), 0.0).sum()
    if not grad:
        return loss, None
    onehot = torch.arange(z.shape[1], device=z.device) == targets.unsqueeze(1)
    dlogits = (torch.exp(z - lse.unsqueeze(1)) - onehot.float()) * (valid * scale).unsqueeze(1)
    return loss, dlogits.to(logits.dtype)


_compiled: list = []  # chunk_loss_and_dlogits compiled once (any chunk length), on first use on CUDA


def _chunk_step(device: torch.device):
    if device.type != "cuda":
        return chunk_loss_and_dlogits
    if not _compiled:
        _compiled.append(torch.compile(chunk_loss_and_dlogits, dynamic=True))
    return _compiled[0]


class LinearCrossEntropy(torch.autograd.Function):
    """loss = reduce(cross_entropy(hidden @ weight^T, targets)); gradients computed in forward (see the module)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, rows_per_chunk: int, grads: bool):
        # scale: [] fp32, the reduction's factor per counted token (1 / count for a mean, 1 for a sum); grads:
        # whether the caller records gradients (inside forward autograd is always off)
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = _chunk_step(hidden.device)
        for start in range(0, hidden.shape[0], rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            h = hidden[rows]
            # the chunk's logits as the eager path computes them (the weight's dtype), then fp32 inside `step`
            loss, g = step(h @ weight.t(), safe[rows], valid[rows], scale, need_h or need_w)
            total = total + loss
            if need_h:
                grad_h[rows] = g @ weight
            if need_w:
                grad_w.addmm_(g.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        if getattr(ctx, "used", False):  # the stored gradients were scaled in place by the first backward
            raise RuntimeError("backward twice through linear_cross_entropy (retain_graph) is not supported")
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        # these tensors are this function's own and die with it: scale them in place (no second [vocab, hidden]
        # buffer) except while a compiler traces, which wants the functional form
        scale = (lambda t: t * grad_out) if torch.compiler.is_compiling() else (lambda t: t.mul_(grad_out))
        return (scale(grad_h) if grad_h is not None else None, scale(grad_w) if grad_w is not None else None,
                None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                         rows_per_chunk: int | None = None) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction=reduction) (targets -100 ignored, mean
    over the counted ones: NaN when there are none, as F.cross_entropy gives) without the whole logits. hidden
    [tokens, hidden_size], weight [vocab, hidden_size]. Under autocast both are cast to its dtype first, as the
    Linear would be."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    hidden, weight, targets = hidden.to(dtype), weight.to(dtype), targets.reshape(-1)
    if reduction == "mean":
        scale = 1.0 / (targets != IGNORE_INDEX).sum().float()
    else:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    rows = rows_per_chunk or loss_chunk_rows(weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return LinearCrossEntropy.apply(hidden, weight, targets, scale, rows, torch.is_grad_enabled())


def head_weight(head: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """The LM head's weight when the chunked loss can take it: a bias-free nn.Linear (not a LoRA- or
    quantization-wrapped head) whose weight and input are whole tensors on this rank, outside fp16; else None (the
    logits path)."""
    from torch.distributed.tensor import DTensor

    if type(head) is not nn.Linear or head.bias is not None:
        return None
    weight = head.weight
    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        return None
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    return None if dtype == torch.float16 else weight


def lm_head_loss(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """The next-token loss of `model`'s final hidden states: chunked where `head_weight` allows, else
    cross-entropy over `model.compute_logits` (vocabulary-sharded under TP's loss_parallel)."""
    weight = head_weight(model.lm_head, hidden)
    if weight is not None:
        return linear_cross_entropy(hidden, weight, targets, reduction)
    return F.cross_entropy(model.compute_logits(hidden), targets.reshape(-1), reduction=reduction)


class CausalLMLoss(nn.Module):
    """Mean next-token cross-entropy of a [B, T] batch through the model's flattened-token interface."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._meta: dict = {}

    def meta(self, batch: int, seq_len: int, device):
        key = (batch, seq_len, str(device))
        if key not in self._meta:
            self._meta[key] = (AttnMeta.causal([seq_len] * batch, device),
                               torch.arange(seq_len, device=device).repeat(batch))
        return self._meta[key]

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        meta, positions = self.meta(*inputs.shape, inputs.device)
        hidden = self.model(inputs.reshape(-1), positions, meta)
        return lm_head_loss(self.model, hidden, targets, reduction)
