"""The trainer on CUDA: bf16 autocast, fused AdamW, torch.compile; resume; the shipped model's greedy text."""
import json
import subprocess
import sys

import pytest
import torch

import brrr
from brrr.train.data import build
from brrr.train.trainer import TrainConfig, Trainer
from tests.train.conftest import TINY_MODEL, write_sources

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-train")
    write_sources(root / "src")
    build(root / "data", [str(root / "src")], vocab=400, val_fraction=0.2, show_progress=False)
    (root / "config.json").write_text(json.dumps(TINY_MODEL))
    return root


def _cfg(root, out, **kw):
    base = dict(seq_len=64, micro_batch=8, max_steps=40, lr=3e-3, warmup_steps=5, eval_every=20, eval_windows=4,
                log_every=10, checkpoint_every=20, final_eval_windows=8)
    return TrainConfig(str(root / "config.json"), str(root / "data"), str(out), **{**base, **kw})


def test_compiled_bf16_training_lowers_the_loss_and_exports(setup, tmp_path):
    summary = Trainer(_cfg(setup, tmp_path, compile=True, activation_checkpointing=True)).run()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in log if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0 and all(0 < r["mfu"] < 1 for r in train)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = brrr.load_model(tmp_path, device="cuda")
    assert summary["val_loss"] < 5.0 and next(model.parameters()).dtype == torch.bfloat16


def test_resume_on_cuda_continues_the_run(setup, tmp_path):
    full = Trainer(_cfg(setup, tmp_path / "full")).run()
    Trainer(_cfg(setup, tmp_path / "split", stop_at=20)).run()
    resumed = Trainer(_cfg(setup, tmp_path / "split", resume=True)).run()
    # CUDA backward kernels (embedding, attention) may sum in any order: same run up to rounding, not bit for bit
    assert resumed["steps"] == full["steps"] == 40
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=0.02)


def test_cli_on_cuda_prints_the_default_models_greedy_text():
    """`brrr generate` (the engine, bf16 on CUDA) prints what the reference generator produces on CUDA."""
    prompt = "def fibonacci(n):"
    expected = brrr.load(device="cuda").generate(prompt, brrr.SamplingParams(max_tokens=24, temperature=0))
    cli = subprocess.run([sys.executable, "-m", "brrr", "generate", prompt, "--temperature", "0", "--max-tokens", "24",
                          "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == prompt + expected + "\n"
