"""Dynamic loss scaling for fp16 training (Micikevicius et al., 2018; the schedule of torch.amp.GradScaler).

fp16 represents nothing below 6e-8 (2^-24), and many gradients are smaller: the loss is multiplied by `scale`
before backward so they stay representable, and the gradients are divided by it before clipping. A step whose
global gradient norm is not finite overflowed somewhere in fp16: it is skipped (the gradients are dropped, and
AdamW leaves parameters without gradients, and their moments, untouched) and the scale halves; after
`growth_interval` finite steps in a row it doubles. The global norm is the same on every rank (it is reduced over
all of them), so every rank skips the same steps without a collective of its own. Scales are powers of two: the
unscaled gradients are bit for bit those of an unscaled backward whenever nothing over- or underflows.
"""
from __future__ import annotations

import torch

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


class DynamicLossScale:
    def __init__(self, scale: float = INIT_SCALE, growth_interval: int = GROWTH_INTERVAL):
        self.scale, self.growth_interval = scale, growth_interval
        self.finite_steps = 0  # finite steps since the last change of scale
        self.overflows = 0  # skipped steps, over the run

    def scaled(self, loss_fn):
        """loss_fn whose loss is multiplied by the current scale (backward then runs on the scaled loss)."""
        def scaled_loss(*args, **kwargs):
            return loss_fn(*args, **kwargs) * self.scale
        return scaled_loss

    def unscaled_clip(self, clip):
        """clip(params, max_norm) run on the unscaled gradients; on an overflow the gradients are dropped (the
        optimizer then skips the step) and the returned norm is 0, so the step is not taken for divergence."""
        def clip_unscaled(params, max_norm):
            inverse = 1.0 / self.scale
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(inverse)
            norm = clip(params, max_norm)
            if torch.isfinite(norm).item():  # fp16 pays this synchronization; bf16 and fp32 never come here
                self.finite_steps += 1
                if self.finite_steps == self.growth_interval:
                    self.scale, self.finite_steps = self.scale * 2, 0
                return norm
            for p in params:
                p.grad = None
            self.scale, self.finite_steps = self.scale / 2, 0
            self.overflows += 1
            return torch.zeros_like(norm)
        return clip_unscaled
