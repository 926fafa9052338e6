"""`brrr train-draft` on CPU: a short run fits an EAGLE head to a briefly trained tiny target (its loss falls and
its top-1 agreement with the target rises on held-out text), and the saved head reloads with the same figures."""
import argparse
import json

import numpy as np
import pytest
import torch

import brrr
from brrr.errors import BrrrError
from brrr.models.eagle import load_head
from brrr.train.cli import register
from brrr.train.draft import DraftConfig, EagleLoss
from brrr.train.trainer import Trainer
from brrr.train.sampler import eval_windows

HEAD_RUN = dict(device="cpu", seq_len=32, micro_batch=4, max_steps=80, lr=3e-3, warmup_steps=4, eval_every=40,
                eval_windows=4, log_every=20, checkpoint_every=40, final_eval_windows=8)


@pytest.fixture(scope="module")
def target_dir(trained_target):
    return trained_target


@pytest.fixture(scope="module")
def head_run(target_dir, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft-head")
    parser = argparse.ArgumentParser(prog="brrr")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train-draft", "--target", str(target_dir), "--data", str(data_dir), "--out", str(out),
                              *[f"--{k.replace('_', '-')}={v}" for k, v in HEAD_RUN.items()]])
    assert args.func(args) == 0
    return out


def test_training_raises_agreement_with_the_target(head_run):
    log = [json.loads(line) for line in (head_run / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "val_top1" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["final"] and last["step"] == 80
    assert last["val_loss"] < 0.75 * first["val_loss"]
    assert last["val_ce"] < first["val_ce"] and last["val_smooth_l1"] < first["val_smooth_l1"]
    assert last["val_top1"] > first["val_top1"] + 0.2, (first["val_top1"], last["val_top1"])
    summary = json.loads((head_run / "train_summary.json").read_text())
    assert summary["steps"] == 80 and summary["val_top1"] == last["val_top1"]
    acc = summary["acceptance"]  # greedy speculative decoding of held-out prompts with the trained head, k = 8
    rates = acc["acceptance_per_position"]
    assert len(rates) == 8 and rates[0] > 0.2 and all(a >= b for a, b in zip(rates, rates[1:]))
    assert acc["mean_acceptance_length"] == pytest.approx(1 + sum(rates))


def test_saved_head_reloads_with_the_same_agreement(head_run, target_dir, data_dir):
    from brrr.token_data import TokenData

    target = brrr.load_model(target_dir, dtype="float32")
    head = load_head(head_run, target)
    config = json.loads((head_run / "config.json").read_text())
    assert config["architectures"] == ["EagleHead"] and config["num_hidden_layers"] == 1
    data, loss = TokenData(data_dir), EagleLoss(head, target)
    val, agree, count = data.splits["val"], 0.0, 0
    for start, end in data.source_ranges("val").values():
        starts, length = eval_windows(start, end, HEAD_RUN["seq_len"], HEAD_RUN["final_eval_windows"])
        for i in range(0, len(starts), HEAD_RUN["micro_batch"]):
            rows = torch.from_numpy(val[starts[i:i + 4, None] + np.arange(length)].astype(np.int64))
            with torch.no_grad():
                top1 = loss.parts(rows[:, :-1], rows[:, 1:])["top1"]
            agree, count = agree + top1.sum().item(), count + top1.numel()
    summary = json.loads((head_run / "train_summary.json").read_text())
    assert agree / count == pytest.approx(summary["val_top1"], abs=1e-9)


def test_bad_input(target_dir, data_dir, tmp_path, head_run):
    with pytest.raises(BrrrError, match="another tokenizer"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "tokenizer.json").write_text("{}")
        (tmp_path / "other" / "config.json").write_text((target_dir / "config.json").read_text())
        Trainer(DraftConfig(str(tmp_path / "other"), str(data_dir), str(tmp_path / "o1"), device="cpu"))
    with pytest.raises(BrrrError, match="already holds a train-draft run"):
        Trainer(DraftConfig(str(target_dir), str(data_dir), str(head_run), device="cpu"))
    with pytest.raises(BrrrError, match="exceeds the target's context"):
        Trainer(DraftConfig(str(target_dir), str(data_dir), str(tmp_path / "o2"), device="cpu", seq_len=4096))


def test_stop_and_resume_gives_the_same_head(head_run, target_dir, data_dir, tmp_path):
    from safetensors.torch import load_file

    cfg = dict(HEAD_RUN, stop_at=40)
    Trainer(DraftConfig(str(target_dir), str(data_dir), str(tmp_path), **cfg)).run()
    Trainer(DraftConfig(str(target_dir), str(data_dir), str(tmp_path), **HEAD_RUN, resume=True)).run()
    want, got = load_file(head_run / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(BrrrError, match="--resume: the checkpoint was trained with seq_len"):
        Trainer(DraftConfig(str(target_dir), str(data_dir), str(tmp_path), **{**HEAD_RUN, "seq_len": 16},
                                 resume=True))
