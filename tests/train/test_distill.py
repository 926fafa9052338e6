"""brrr distill: the KL losses against a direct torch computation, distillation closing the student's KL to the
teacher faster than hard labels alone, a pruned student keeping its zeros, and the refused inputs."""
import json

import pytest
import torch
import torch.nn.functional as F

from brrr.cli import main
from brrr.prune.mask import is_n_m
from brrr.quant.linear import projections
from brrr.train.distill import DistillConfig
from brrr.train.kd_loss import kd_loss
from brrr.train.trainer import Trainer
from tests.cli import refuses

STUDENT = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
RUN = dict(device="cpu", seq_len=32, micro_batch=4, max_steps=30, lr=3e-3, warmup_steps=3, eval_every=30,
           eval_windows=4, log_every=10, checkpoint_every=30, final_eval_windows=8)


def test_forward_and_reverse_kl_against_torch():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 40, generator=gen, requires_grad=True), torch.randn(6, 40, generator=gen)
    for T in (1.0, 2.5):
        log_q, log_p = F.log_softmax(s / T, -1), F.log_softmax(t / T, -1)
        forward = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * T * T
        reverse = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1) * T * T
        torch.testing.assert_close(kd_loss(s, t, "forward", T), forward)
        torch.testing.assert_close(kd_loss(s, t, "reverse", T), reverse)
        g1, = torch.autograd.grad(kd_loss(s, t, "forward", T).sum(), s)
        g2, = torch.autograd.grad(forward.sum(), s)
        torch.testing.assert_close(g1, g2)
    assert kd_loss(t, t).abs().max() < 1e-6 and kd_loss(t, t, "reverse").abs().max() < 1e-6
    # top-k: the teacher renormalised over its k best tokens, the student's full log-probabilities there
    idx = t.topk(5, -1).indices
    p = F.softmax(t.gather(-1, idx), -1)
    log_q = F.log_softmax(s, -1).gather(-1, idx)
    torch.testing.assert_close(kd_loss(s, t, "forward", 1.0, top_k=5), (p * (p.log() - log_q)).sum(-1))
    q = F.softmax(log_q, -1)
    torch.testing.assert_close(kd_loss(s, t, "reverse", 1.0, top_k=5), (q * (q.log() - p.log())).sum(-1))
    torch.testing.assert_close(kd_loss(s, t, top_k=40), kd_loss(s, t))


@pytest.fixture(scope="module")
def student_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("student") / "config.json"
    path.write_text(json.dumps(STUDENT))
    return path


def distil(teacher, student, data, out, **flags):
    return Trainer(DistillConfig(str(teacher), str(student), str(data), str(out), **{**RUN, **flags})).run()


def test_distillation_closes_the_kl_that_hard_labels_alone_do_not(trained_target, student_config, data_dir,
                                                                   tmp_path):
    hard = distil(trained_target, student_config, data_dir, tmp_path / "hard", alpha=1.0)
    soft = distil(trained_target, student_config, data_dir, tmp_path / "soft", alpha=0.0, temperature=1.0)
    log = [json.loads(line) for line in (tmp_path / "soft" / "train_log.jsonl").read_text().splitlines()]
    start = next(r for r in log if "val_kl" in r)["val_kl"]
    assert soft["val_kl"] < 0.9 * hard["val_kl"] and soft["val_kl"] < 0.25 * start, (start, hard, soft)
    assert any("kl" in r and "ce" in r for r in log)  # the step log carries both parts of the loss
    import transformers

    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "soft")
    assert out.config.hidden_size == 32 and (tmp_path / "soft" / "tokenizer.json").is_file()


def test_a_pruned_student_keeps_its_zeros(trained_target, source_dir, tmp_path):
    """From a text file (tokenized with the teacher's tokenizer) into the teacher pruned 2:4."""
    text = tmp_path / "text.py"
    text.write_text("\n".join(f.read_text() for f in sorted(source_dir.rglob("mod_*.py"))))
    pruned = tmp_path / "pruned"
    assert main(["prune", "--model", str(trained_target), "--method", "magnitude", "--pattern", "2:4",
                 "--out", str(pruned)]) == 0
    summary = distil(trained_target, pruned, text, tmp_path / "out", max_steps=10, eval_every=10,
                     checkpoint_every=10, alpha=0.0, lr=3e-4)
    import brrr

    model = brrr.load(tmp_path / "out", device="cpu").model
    assert all(is_n_m(m.weight, 2, 4) for _, m in projections(model))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sparsity_config"]["global_sparsity"] == 0.5
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert summary["val_kl"] < next(r for r in log if "val_kl" in r)["val_kl"]


def test_bad_input_is_named(trained_target, student_config, data_dir, tmp_path, capsys):
    base = ["distill", "--teacher", str(trained_target), "--data", str(data_dir), "--out", str(tmp_path / "o"),
            "--device", "cpu", "--seq-len", "32"]
    refuses(capsys, base + ["--student", str(student_config), "--alpha", "1.5"], "--alpha must be in [0, 1]")
    refuses(capsys, base + ["--student", str(student_config), "--temperature", "0"], "--temperature must be > 0")
    refuses(capsys, base + ["--student", str(student_config), "--tp", "2"], "data parallelism only")
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({**STUDENT, "vocab_size": 1000}))
    refuses(capsys, base + ["--student", str(wide)], "differs from the teacher's")
    refuses(capsys, base + ["--student", str(student_config), "--seq-len", "4096"], "exceeds the model's context")


def test_stop_and_resume(trained_target, student_config, data_dir, tmp_path):
    flags = dict(max_steps=8, eval_every=8, checkpoint_every=4, temperature=1.0, kind="reverse", teacher_top_k=16)
    distil(trained_target, student_config, data_dir, tmp_path / "r", stop_at=4, **flags)
    summary = distil(trained_target, student_config, data_dir, tmp_path / "r", resume=True, **flags)
    whole = distil(trained_target, student_config, data_dir, tmp_path / "whole", **flags)
    assert summary["steps"] == whole["steps"] == 8
    assert summary["val_kl"] == pytest.approx(whole["val_kl"], rel=1e-4)
