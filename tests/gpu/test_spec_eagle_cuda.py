"""The EAGLE head on CUDA: the proposer (Triton attention over its paged cache) drafts what a plain recomputation
does, and train-draft (bf16 autocast over a bf16 target) fits a head that reloads."""
import json

import pytest
import torch

import brrr
from brrr.engine.spec.eagle import EagleProposer
from brrr.engine.spec.proposer import SpecInput
from brrr.models.eagle import load_head, new_head
from brrr.train.data import build
from brrr.train.draft import DraftConfig
from brrr.train.trainer import TrainConfig, Trainer
from tests import hf_models
from tests.engine.test_spec_eagle import features, reference_drafts, tokens
from tests.train.conftest import TINY_MODEL, write_sources

pytestmark = pytest.mark.gpu


def test_proposer_matches_recomputation_on_cuda(tmp_path):
    hf_models.save(hf_models.build("llama3-rope"), tmp_path)
    target = brrr.load_model(tmp_path, dtype="float32", device="cuda")
    head = new_head(target, seed=1).requires_grad_(False).eval()
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.2)
    seqs = [tokens(0, 9), tokens(1, 40), tokens(2, 12)]
    prop = EagleProposer(head, target)
    full = [features(target, s) for s in seqs]
    got = prop.propose([SpecInput(i, s[:-4], f[:-5]) for i, (s, f) in enumerate(zip(seqs, full))], 4)
    assert got == [reference_drafts(target, head, s[:-4], 4) for s in seqs]
    got = prop.propose([SpecInput(i, s, f[-5:-1]) for i, (s, f) in enumerate(zip(seqs, full))], 4)
    assert got == [reference_drafts(target, head, s, 4) for s in seqs]
    for i in range(3):
        prop.release(i)
    assert prop.blocks_in_use() == 0


def test_train_draft_on_cuda(tmp_path):
    write_sources(tmp_path / "src")
    build(tmp_path / "data", [str(tmp_path / "src")], vocab=400, val_fraction=0.2, show_progress=False)
    (tmp_path / "config.json").write_text(json.dumps(TINY_MODEL))
    Trainer(TrainConfig(str(tmp_path / "config.json"), str(tmp_path / "data"), str(tmp_path / "target"),
                        seq_len=64, micro_batch=8, max_steps=40, lr=3e-3, warmup_steps=5, eval_every=40,
                        eval_windows=2, final_eval_windows=2)).run()
    summary = Trainer(DraftConfig(str(tmp_path / "target"), str(tmp_path / "data"), str(tmp_path / "head"),
                                       seq_len=64, micro_batch=8, max_steps=80, lr=3e-3, warmup_steps=4,
                                       eval_every=80, eval_windows=4, final_eval_windows=8)).run()
    log = [json.loads(line) for line in (tmp_path / "head" / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "val_top1" in r]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] and evals[-1]["val_top1"] > evals[0]["val_top1"] + 0.2
    target = brrr.load_model(tmp_path / "target", dtype="bfloat16", device="cuda")
    head = load_head(tmp_path / "head", target)
    assert next(head.parameters()).dtype == torch.bfloat16 and summary["device"].startswith("cuda")
