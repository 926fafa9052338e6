"""`brrr train --cp 2` and `--cp 2 --dp-shard 2` on gloo processes against one process with the same global
batch: the loss curve over 10 steps within 5e-5 (fp32 reduction order), the final weights within 1e-4, the
validation loss too (evaluation runs through the ring, its windows padded to the 2 x cp chunks); a CP run's
sharded checkpoint resumes on one process on the same curve; layouts CP does not take are refused by flag."""
import json

import pytest
import torch
from safetensors.torch import load_file

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.train.parallel.layout import Layout, check_model
from brrr.train.trainer import TrainConfig, Trainer
from tests.train.conftest import TINY_MODEL
from tests.train.distributed_helpers import spawn, train_losses

LOSS_ATOL, WEIGHT_ATOL = 5e-5, 1e-4
GLOBAL_MICRO_BATCH = 4
TRAIN_STEPS = 10  # enough for warmup and a resume across layouts; each step is a gloo round


def _cfg(model, data_dir, out, dp: int, **kw) -> TrainConfig:
    base = dict(device="cpu", seq_len=32, micro_batch=GLOBAL_MICRO_BATCH // dp, grad_accum=2, max_steps=TRAIN_STEPS,
                lr=3e-3, warmup_steps=2, eval_every=100, eval_windows=2, log_every=1, checkpoint_every=100,
                final_eval_windows=2)
    return TrainConfig(str(model), str(data_dir), str(out), **{**base, **kw})


@pytest.fixture(scope="module")
def runs(tiny_config, data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_runs")
    outs = {name: root / name for name in ("single", "cp2", "cp2_fsdp2", "trip")}
    Trainer(_cfg(tiny_config, data_dir, outs["single"], 1)).run()
    spawn(2, [_cfg(tiny_config, data_dir, outs["cp2"], 1, cp=2)])
    spawn(4, [_cfg(tiny_config, data_dir, outs["cp2_fsdp2"], 2, cp=2, dp_shard=2),
              _cfg(tiny_config, data_dir, outs["trip"], 2, cp=2, dp_shard=2, stop_at=3)])
    Trainer(_cfg(tiny_config, data_dir, outs["trip"], 1, resume=True)).run()
    return outs


@pytest.mark.parametrize("name", ["cp2", "cp2_fsdp2"])
def test_context_parallel_matches_one_process(runs, name):
    ref, out = runs["single"], runs[name]
    losses = train_losses(out)
    assert len(losses) == TRAIN_STEPS
    assert losses == pytest.approx(train_losses(ref), abs=LOSS_ATOL)
    want, got = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=WEIGHT_ATOL, rtol=0, msg=key)
    summary = json.loads((out / "train_summary.json").read_text())
    reference = json.loads((ref / "train_summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], abs=LOSS_ATOL)
    assert summary["tokens_seen"] == reference["tokens_seen"] == TRAIN_STEPS * 2 * GLOBAL_MICRO_BATCH * 32


def test_a_cp_checkpoint_resumes_on_one_process(runs):
    """Steps 1-3 on --cp 2 --dp-shard 2 (its DCP checkpoint sharded over dp_shard x cp), 4-6 on one process."""
    assert train_losses(runs["trip"]) == pytest.approx(train_losses(runs["single"]), abs=LOSS_ATOL)


def test_layouts_context_parallel_cannot_take_are_refused_by_flag():
    cfg = ModelConfig.from_hf({**TINY_MODEL, "vocab_size": 400})
    with pytest.raises(BrrrError, match="--cp 2 splits each sequence into 2 x 2 chunks.*--seq-len 30"):
        check_model(Layout(dp_shard=1, cp=2), cfg, 2, 30)
    with pytest.raises(BrrrError, match="with --tp or --pp it is not supported"):
        check_model(Layout(dp_shard=1, cp=2, tp=2), cfg, 2, 32)
    with pytest.raises(BrrrError, match="x --cp 3 = 3 does not divide the world size 4"):
        Layout(cp=3).resolve(4)
    assert Layout(cp=2).resolve(8) == Layout(1, 4, 1, 1, 2)
