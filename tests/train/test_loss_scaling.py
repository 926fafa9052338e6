"""fp16's dynamic loss scaling: an overflowing step is skipped (parameters and Adam state untouched) and halves the
scale, finite steps unscale exactly (powers of two) and grow it; `brrr train --fp16` trains through overflows and
logs the scale and the count."""
import json
import math

import torch

from brrr.train.loss_scaling import DynamicLossScale
from brrr.train.parallel import clip_grad_norm
from brrr.train.trainer import TrainConfig, Trainer


def _linear_with_grads(scale: float):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    (layer(torch.randn(5, 4)).square().sum() * scale).backward()
    return layer


def test_an_overflow_skips_the_step_and_halves_the_scale():
    layer = _linear_with_grads(2.0**10)
    layer.weight.grad[0, 0] = float("inf")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    scaler = DynamicLossScale(2.0**10)
    norm = scaler.unscaled_clip(clip_grad_norm)(list(layer.parameters()), 1.0)
    optimizer.step()
    assert norm.item() == 0 and scaler.scale == 2.0**9 and scaler.overflows == 1
    assert all(p.grad is None for p in layer.parameters())
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before)) and not optimizer.state


def test_finite_steps_unscale_exactly_and_grow_the_scale():
    reference = _linear_with_grads(1.0)
    want = [p.grad.clone() for p in reference.parameters()]
    scaler = DynamicLossScale(2.0**12, growth_interval=2)
    for step in range(2):
        layer = _linear_with_grads(scaler.scale)
        scaler.unscaled_clip(clip_grad_norm)(list(layer.parameters()), 1e9)
        assert all(torch.equal(p.grad, w) for p, w in zip(layer.parameters(), want))
    assert scaler.scale == 2.0**13 and scaler.overflows == 0


def test_fp16_training_skips_overflowing_steps_and_logs_them(tiny_config, data_dir, tmp_path):
    cfg = TrainConfig(str(tiny_config), str(data_dir), str(tmp_path), device="cpu", seq_len=32, micro_batch=8,
                      max_steps=10, lr=3e-3, warmup_steps=2, log_every=1, eval_every=100, eval_windows=2,
                      checkpoint_every=100, final_eval_windows=2, fp16=True)
    trainer = Trainer(cfg)
    # backward's fp16 activations' gradients grow with the scale: at 2^21 this model's exceed fp16's 65504
    trainer.train_step.loss_scale.scale = 2.0**21
    trainer.run()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines() if '"loss"' in line]
    assert log[0]["overflow_steps"] == 1 and log[0]["loss_scale"] == 2.0**20 and log[0]["grad_norm"] == 0
    skipped = log[-1]["overflow_steps"]
    assert 1 <= skipped <= 4 and log[-1]["loss_scale"] == 2.0 ** (21 - skipped)
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    assert all(math.isfinite(r["loss"]) for r in log)


def test_a_resumed_fp16_run_keeps_its_loss_scale(tiny_config, data_dir, tmp_path):
    common = dict(device="cpu", seq_len=32, micro_batch=8, max_steps=6, lr=3e-3, warmup_steps=2, log_every=1,
                  eval_every=100, eval_windows=2, checkpoint_every=100, final_eval_windows=1, fp16=True)
    first = Trainer(TrainConfig(str(tiny_config), str(data_dir), str(tmp_path), stop_at=3, **common))
    first.train_step.loss_scale.scale = 2.0**21
    first.run()
    stopped = first.train_step.loss_scale
    assert stopped.overflows >= 1
    resumed = Trainer(TrainConfig(str(tiny_config), str(data_dir), str(tmp_path), resume=True, **common))
    scale = resumed.train_step.loss_scale
    assert (scale.scale, scale.finite_steps, scale.overflows) == (stopped.scale, stopped.finite_steps,
                                                                  stopped.overflows)
