"""The training loop's task interface (brrr/train/task.py): a task written here in a few lines trains through the
loop (its loss falls, --resume continues it bit for bit); each shipped task (pretraining, LoRA SFT, the EAGLE
head) runs a step through the same Trainer; the composed configs take the flat flags and the CLI keeps its
defaults."""
import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brrr.errors import BrrrError
from brrr.train.cli import register
from brrr.train.config import LoopConfig, RunConfig, flat_flags
from brrr.train.draft import DraftConfig, DraftTask
from brrr.train.finetune import FinetuneConfig, FinetuneTask
from brrr.train.pretrain import PretrainTask, TrainConfig
from brrr.train.trainer import Trainer

DIM = 8
TRUE_W = torch.linspace(-1, 1, DIM)


class Samples:
    """Micro-batch `position`: x ~ N(0, 1), y = x . TRUE_W + noise, drawn from a generator seeded by the position
    (so a resumed run draws the same batches)."""

    def __init__(self, rows: int):
        self.rows = rows

    def batch_at(self, position: int, device):
        g = torch.Generator().manual_seed(position)
        x = torch.randn(self.rows, DIM, generator=g)
        return x.to(device), (x @ TRUE_W + 0.01 * torch.randn(self.rows, generator=g)).to(device)

    def epoch(self, position: int) -> float:
        return 0.0


class LinearTask:
    """The smallest task: fit a linear map to Samples with the mean squared error."""
    command, run_name, parallel, eval_at_start = "fit-linear", "fit-linear", False, True

    def configure(self, run):
        return None  # no transformer: nothing for the (one-process) layout to check

    def build(self, run):
        torch.manual_seed(run.cfg.seed)
        self.model = self.checkpointed = nn.Linear(DIM, 1).to(run.device)
        self.batches = Samples(run.cfg.micro_batch)
        self.loss_fn = lambda x, y: F.mse_loss(self.model(x).squeeze(-1), y)
        self.flops_per_token = 6 * DIM
        return self.model

    def resume_key(self, run):
        return {"micro_batch": run.cfg.micro_batch, "seed": run.cfg.seed}

    def describe(self, run):
        return f"fitting a {DIM}-wide linear map"

    @torch.no_grad()
    def evaluate(self, run, max_windows):
        x, y = Samples(64).batch_at(10**6, run.device)  # a held-out position
        return {"val_loss": F.mse_loss(self.model(x).squeeze(-1), y).item()}

    def eval_line(self, val):
        return f"val loss {val['val_loss']:.5f}"

    def eval_tokens(self, max_windows):
        return 64

    def predicted_memory(self, run):
        return None

    def log_fields(self):
        return {"weight_error": (self.model.weight.detach()[0] - TRUE_W).norm().item()}

    def summary(self, run, final):
        return {"weight_error": self.log_fields()["weight_error"]}

    def export(self, run):
        torch.save(self.model.state_dict(), run.out / "linear.pt")
        return {"exported": "linear.pt"}


def _loop(out, **kw):
    base = dict(device="cpu", seq_len=1, micro_batch=16, grad_accum=2, max_steps=60, lr=0.05, warmup_steps=5,
                weight_decay=0.0, eval_every=20, log_every=10, checkpoint_every=20)
    return RunConfig(LoopConfig(str(out), **{**base, **kw}))


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_a_task_written_here_trains_through_the_loop(tmp_path):
    summary = Trainer(_loop(tmp_path), LinearTask()).run()
    log = _log(tmp_path)
    evals = [r["val_loss"] for r in log if "val_loss" in r]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [10, 20, 30, 40, 50, 60]
    assert evals[0] > 0.5 and evals[-1] < 0.01 * evals[0]  # the untrained figure at step 0, then the fit
    assert steps[-1]["loss"] < 0.01 * steps[0]["loss"] and steps[-1]["weight_error"] < 0.05  # the task's log field
    assert summary["steps"] == 60 and summary["exported"] == "linear.pt" and summary["weight_error"] < 0.05
    assert summary["tokens_seen"] == 60 * 2 * 16
    assert json.loads((tmp_path / "train_config.json").read_text())["lr"] == 0.05


def test_a_task_written_here_resumes_bit_for_bit(tmp_path):
    Trainer(_loop(tmp_path / "straight"), LinearTask()).run()
    Trainer(_loop(tmp_path / "split", stop_at=30), LinearTask()).run()
    with pytest.raises(BrrrError, match="already holds a fit-linear run"):
        Trainer(_loop(tmp_path / "split"), LinearTask())
    Trainer(_loop(tmp_path / "split", resume=True), LinearTask()).run()
    want, got = (torch.load(tmp_path / d / "linear.pt") for d in ("straight", "split"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(BrrrError, match="trained with micro_batch=16, this run has 8"):
        Trainer(_loop(tmp_path / "split", resume=True, micro_batch=8), LinearTask())


def test_a_one_process_task_is_refused_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(BrrrError, match="WORLD_SIZE=2: brrr fit-linear runs one process"):
        Trainer(_loop(tmp_path), LinearTask())


ONE_STEP = dict(device="cpu", max_steps=1, warmup_steps=0, eval_every=1, eval_windows=1, log_every=1,
                checkpoint_every=1, final_eval_windows=1)


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    from tests.hf_models import build, save, save_tokenizer
    from tests.lora.test_finetune import write_chat

    root = tmp_path_factory.mktemp("sft")
    return save_tokenizer(save(build("llama3-rope", vocab_size=320), root / "model")), write_chat(root / "chat.jsonl", 16)


def _configs(kind, tiny_config, data_dir, trained_target, sft_setup, out):
    if kind == "pretrain":
        return TrainConfig(str(tiny_config), str(data_dir), str(out), seq_len=32, micro_batch=2, **ONE_STEP)
    if kind == "finetune":
        model, chat = sft_setup
        return FinetuneConfig(str(model), str(chat), str(out), seq_len=64, micro_batch=2, grad_accum=1, lora_r=4,
                              **ONE_STEP)
    return DraftConfig(str(trained_target), str(data_dir), str(out), seq_len=32, micro_batch=2, **ONE_STEP)


TASKS = {"pretrain": (PretrainTask, "model.safetensors"), "finetune": (FinetuneTask, "adapter_model.safetensors"),
         "draft": (DraftTask, "model.safetensors")}


@pytest.mark.parametrize("kind", list(TASKS))
def test_each_shipped_task_runs_a_step_through_the_one_loop(kind, tiny_config, data_dir, trained_target, sft_setup,
                                                            tmp_path):
    task_class, output = TASKS[kind]
    trainer = Trainer(_configs(kind, tiny_config, data_dir, trained_target, sft_setup, tmp_path))
    assert type(trainer) is Trainer and type(trainer.task) is task_class
    frozen = sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad)
    before = [p.detach().clone() for p in trainer.params]
    summary = trainer.run()
    (step,) = [r for r in _log(tmp_path) if "loss" in r]
    assert step["step"] == 1 and torch.isfinite(torch.tensor(step["loss"])) and step["tokens_per_s"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))  # the step moved what trains
    assert (frozen > 0) == (kind == "finetune")  # LoRA's base is frozen; the draft's target is outside its head
    assert summary["steps"] == 1 and "val_loss" in summary and (tmp_path / output).is_file()
    assert (tmp_path / "checkpoint" / "state.pt").is_file()


@pytest.mark.parametrize("kind", list(TASKS))
def test_each_task_reports_mfu_and_its_memory_on_a_known_gpu(kind, tiny_config, data_dir, trained_target, sft_setup,
                                                             tmp_path, monkeypatch):
    """The paths a GPU takes (MFU from the task's FLOPs per token, the memory prediction), on the CPU: the trainer is
    told it runs on an H100."""
    from brrr.analysis.hardware import get_gpu
    from brrr.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "device_gpu", lambda device: get_gpu("h100"))
    trainer = Trainer(_configs(kind, tiny_config, data_dir, trained_target, sft_setup, tmp_path))
    trainer.run()
    (step,) = [r for r in _log(tmp_path) if "loss" in r]
    assert 0 < step["mfu"] < 1e-3  # a tiny model on a CPU, counted against an H100's peak


def test_configs_compose_the_flat_flags_and_refuse_an_unknown_one():
    cfg = TrainConfig("m", "d", "o", lr=1e-3, tp=2, compile=True)
    assert (cfg.loop.lr, cfg.parallel.tp, cfg.task.compile, cfg.loop.out, cfg.task.model) == (1e-3, 2, True, "o", "m")
    ft = FinetuneConfig(None, "d", "o", lora_r=8, micro_batch=2)
    assert (ft.task.lora_r, ft.loop.micro_batch, ft.loop.grad_accum, ft.loop.seq_len) == (8, 2, 4, None)
    assert DraftConfig("t", "d", "o").loop.seq_len == 512
    with pytest.raises(TypeError, match="unknown flag.*compile"):
        FinetuneConfig(None, "d", "o", compile=True)  # fine-tuning has no --compile
    with pytest.raises(TypeError, match="unknown flag.*tp"):
        DraftConfig("t", "d", "o", tp=2)  # one process
    assert set(flat_flags(cfg)) >= {"model", "data", "out", "lr", "tp", "compile", "seq_len"}


def test_the_cli_keeps_every_flag_and_default():
    """The defaults each command's --help shows, as they were before the configs were composed."""
    parser = argparse.ArgumentParser(prog="brrr")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    defaults = {cmd: {a.dest: a.default for a in sub.choices[cmd]._actions if a.dest != "help"}
                for cmd in ("train", "finetune", "train-draft")}
    loop = dict(beta1=0.9, grad_clip=1.0, log_every=10, min_lr_ratio=0.1, seed=0, resume=False, stop_at=None,
                device=None, data=None, out=None, model=None)
    assert defaults["train"] == dict(
        loop, activation_checkpointing=False, activation_checkpointing_every=1, async_checkpoint=False, beta2=0.95,
        checkpoint_every=500, compile=False, cp=1, dp_replicate=1, dp_shard=-1, ep=1, eval_every=250, eval_windows=64,
        export_dtype="auto", final_eval_windows=None, fp16=False, grad_accum=1, lr=6e-4, max_steps=1000,
        micro_batch=16, microbatches=None, pp=1, pp_schedule="1f1b", reshard_after_forward=True,
        moe_bias_update_speed=0.0, router_aux_loss_coef=None, router_z_loss_coef=0.0, seq_len=1024,
        time_budget=None, tp=1, warmup_steps=100, weight_decay=0.1)
    assert defaults["finetune"] == dict(
        loop, activation_checkpointing="full", adapter=None, beta2=0.999, checkpoint_every=100, dtype="auto",
        eval_data=None, eval_every=50, eval_windows=64, grad_accum=4, lora_alpha=32.0, lora_dropout=0.05, lora_r=16,
        lr=2e-4, max_steps=500, micro_batch=1, qlora=False, seq_len=None,
        target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", use_dora=False, use_rslora=False,
        val_fraction=0.1, warmup_steps=10, weight_decay=0.0)
    del loop["beta1"]
    assert defaults["train-draft"] == dict(
        loop, checkpoint_every=500, eval_every=200, eval_windows=32, final_eval_windows=128, grad_accum=1, lr=3e-4,
        max_steps=2000, micro_batch=8, seq_len=512, time_budget=None, warmup_steps=50, weight_decay=0.0)
    # every flag lands in its command's config, and the library's defaults are the CLI's
    for cmd, cls in (("train", TrainConfig), ("finetune", FinetuneConfig), ("train-draft", DraftConfig)):
        flags = {k: v for k, v in defaults[cmd].items() if k not in ("model", "data", "out")}
        built = cls("m", "d", "o", **flags)
        assert {k: v for k, v in flat_flags(built).items() if k in flags} == flags
        library = flat_flags(cls("m", "d", "o"))
        assert {k: library[k] for k in flags} == flags, cmd
