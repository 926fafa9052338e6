"""The trainer on CPU: the loss falls, a stopped run resumes bit for bit, the output loads in transformers and
brrr with matching logits, and a diverging run stops with its last good checkpoint kept."""
import json
import os
import re
import signal

import pytest
import torch

import brrr
from brrr.train.trainer import TrainConfig, Trainer, TrainingDiverged, lr_at, rate


def _config(tiny_config, data_dir, out, **kw):
    base = dict(device="cpu", seq_len=32, micro_batch=4, grad_accum=2, max_steps=30, lr=3e-3, warmup_steps=5,
                eval_every=10, eval_windows=4, log_every=5, checkpoint_every=10, final_eval_windows=8)
    return TrainConfig(str(tiny_config), str(data_dir), str(out), **{**base, **kw})


@pytest.fixture(scope="module")
def full_run(tiny_config, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    summary = Trainer(_config(tiny_config, data_dir, out)).run()
    return out, summary


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_thirty_steps_lower_the_loss(full_run):
    out, summary = full_run
    train = [r for r in _log(out) if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # 6 (= ln 400) at the start
    evals = [r for r in _log(out) if "val_loss" in r]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert summary["steps"] == 30 and summary["tokens_seen"] == 30 * 2 * 4 * 32
    assert summary["val_ppl"] == pytest.approx(2.718281828 ** summary["val_loss"])


def test_stop_and_resume_is_bit_identical(full_run, tiny_config, data_dir, tmp_path):
    out, _ = full_run
    halted = Trainer(_config(tiny_config, data_dir, tmp_path, stop_at=13)).run()
    assert halted["halted"] and halted["steps"] == 13
    resumed = Trainer(_config(tiny_config, data_dir, tmp_path, resume=True)).run()
    assert resumed["steps"] == 30 and not resumed["halted"]
    a = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert a["trainer"]["position"] == b["trainer"]["position"] and resumed["val_loss"] == _summary(out)["val_loss"]


def _summary(out):
    return json.loads((out / "train_summary.json").read_text())


def test_output_loads_in_transformers_and_brrr_with_matching_logits(full_run):
    transformers = pytest.importorskip("transformers")
    out, _ = full_run
    ids = [0, 17, 42, 99, 250, 3, 7, 311, 5, 64]
    with torch.no_grad():
        ours = brrr.forward_logits(brrr.load_model(out), ids)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x * 2\n"
    assert hf_tok(text)["input_ids"] == brrr.Tokenizer.from_dir(out).encode(text)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 4]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_config, data_dir, tmp_path):
    cfg = _config(tiny_config, data_dir, tmp_path, lr=1e4, warmup_steps=0, grad_clip=1e9, log_every=2,
                  checkpoint_every=2)
    with pytest.raises(TrainingDiverged, match=r"became NaN/inf between steps (\d+) and (\d+).*Last good checkpoint"):
        Trainer(cfg).run()
    state = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert not (tmp_path / "model.safetensors").exists()


def test_resume_refuses_a_different_geometry(full_run, tiny_config, data_dir):
    out, _ = full_run
    with pytest.raises(brrr.BrrrError, match="trained with micro_batch=4, this run has 8"):
        Trainer(_config(tiny_config, data_dir, out, micro_batch=8, resume=True))
    with pytest.raises(brrr.BrrrError, match="already holds a training run"):
        Trainer(_config(tiny_config, data_dir, out))


def test_schedule_warms_up_then_follows_the_cosine():
    cfg = TrainConfig("m", "d", "o", lr=1.0, warmup_steps=10, min_lr_ratio=0.1).loop
    assert lr_at(0, cfg, 110) == pytest.approx(0.1) and lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55) and lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_ctrl_c_writes_a_checkpoint_says_where_and_resumes(tiny_config, data_dir, tmp_path, capsys):
    """The first SIGINT lets the step in flight finish, then the run writes its checkpoint, names it, and stops;
    --resume continues from that step."""
    cfg = _config(tiny_config, data_dir, tmp_path, max_steps=20, log_every=100, checkpoint_every=100)
    trainer = Trainer(cfg)
    real, calls = trainer.loss_fn, []

    def loss_fn(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * 3:  # during step 3 (two micro-batches a step)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    trainer.loss_fn = loss_fn
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    checkpoint = tmp_path / "checkpoint" / "state.pt"
    assert torch.load(checkpoint, weights_only=False)["trainer"]["step"] == 3
    err = capsys.readouterr().err
    assert f"interrupted: checkpoint of step 3 written to {checkpoint}; continue with the same command and --resume" \
        in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the trainer's handler is gone
    assert Trainer(_config(tiny_config, data_dir, tmp_path, max_steps=5, resume=True)).run()["steps"] == 5


def test_warns_when_max_steps_ends_inside_the_warmup(tiny_config, data_dir, tmp_path, capsys):
    Trainer(_config(tiny_config, data_dir, tmp_path, max_steps=4, warmup_steps=10, final_eval_windows=1)).run()
    out, err = capsys.readouterr()
    assert "warning: --max-steps 4 ends inside the 10 --warmup-steps: the learning rate peaks at 1.20e-03" in err
    assert "step      4/4" in out


def test_printed_log_lines_carry_an_eta(tiny_config, data_dir, tmp_path, capsys):
    Trainer(_config(tiny_config, data_dir, tmp_path, max_steps=10, final_eval_windows=1)).run()
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert re.search(r"^step +5/10 \| .* \| ETA \d+s$", steps[0]), steps
    assert "ETA" not in steps[-1]  # the last step has nothing left


@pytest.mark.parametrize("selective", [False, True])
def test_compiled_checkpointed_layers_are_traced_into_graphs(selective):
    """torch.compile of a layer whose forward was wrapped for recomputation must capture a graph: a
    functools.partial of checkpoint as the forward ran eagerly, silently (the 8B benchmark's missing 20%)."""
    from torch._dynamo.utils import counters

    from brrr.config import ModelConfig
    from brrr.train.loss import CausalLMLoss
    from brrr.train.parallel import decoder_layers
    from brrr.train.pretrain import build_model
    from brrr.train.trainer import checkpoint_activations

    from tests.train.conftest import TINY_MODEL

    cfg = ModelConfig.from_hf({**TINY_MODEL, "vocab_size": 128})
    want_model, model = build_model(cfg, "cpu"), build_model(cfg, "cpu")
    checkpoint_activations(model, selective=selective)
    torch._dynamo.reset()
    counters.clear()
    for layer in decoder_layers(model):
        layer.compile(backend="aot_eager")  # dynamo's capture and AOT autograd as inductor gets them, no codegen
    x = torch.randint(0, 128, (2, 17))
    losses = []
    for m in (want_model, model):
        loss = CausalLMLoss(m)(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    graphs, aot = counters["stats"]["unique_graphs"], counters["aot_autograd"]["ok"]
    torch._dynamo.reset()
    assert graphs >= 1 and aot >= 1, (graphs, aot)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, p), q in zip(model.named_parameters(), want_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_log_line_rates_print_small_values_plainly():
    # a CPU finetune or a loaded machine logs tens of tokens/s, which a fixed k suffix showed as "0.0k tok/s"
    assert [rate(x) for x in (0.43, 9.94, 42.4, 999.4, 1000.0, 12_345.0, 1_234_567.0)] == \
        ["0.4", "9.9", "42", "999", "1.0k", "12.3k", "1,234.6k"]
