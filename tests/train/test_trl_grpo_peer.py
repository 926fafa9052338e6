"""bench/trl_grpo.py (TRL's GRPOTrainer on `brrr bench rl`'s setup) for one step on the shipped default model: one
record, the same on stdout and in the file, with its timings positive and inside the step, its generation tokens
what TRL's own completions/mean_length counts, and the run's machine, command, config and TRL version."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the peer harness runs TRL's GRPOTrainer")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer takes a datasets.Dataset")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trl_grpo.py"


def harness():
    spec = importlib.util.spec_from_file_location("trl_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_step_writes_one_record(tmp_path, capsys):
    import trl

    out = tmp_path / "trl.jsonl"
    argv = ["--num-prompts", "2", "--num-generations", "2", "--max-completion-length", "8", "--steps", "1",
            "--device", "cpu", "--out", str(out)]
    assert harness().main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records and [r["step"] for r in records] == [1]
    r = records[0]
    assert r["bench"] == "rl-peer-trl" and r["machine"] == "cpu" and r["device"] == "cpu"
    assert r["model"] == "default" and r["weights"] == "loaded" and r["trl"] == trl.__version__
    assert r["command"] == "python bench/trl_grpo.py " + " ".join(argv[:-2])
    c = r["config"]
    assert (c["num_prompts"], c["num_generations"], c["max_completion_length"], c["steps"]) == (2, 2, 8, 1)
    assert (c["micro_batch"], c["grad_accum"], c["generation_batch_size"], c["beta"]) == (2, 2, 4, 0.0)
    assert c["reward"] == "python_syntax" and c["gradient_checkpointing"] is False
    for key in ("step_s", "generation_s", "generation_tokens", "generation_tok_s", "generated_positions", "score_s",
                "train_s", "trl_step_time"):
        assert r[key] > 0, key
    assert r["generation_s"] + r["score_s"] < r["step_s"] and r["train_s"] < r["step_s"]
    assert 4 <= r["generation_tokens"] <= r["generated_positions"] <= 2 * 2 * 8
    assert r["generation_tokens"] == round(r["completions_mean_length"] * 4)  # the wrapper counts as TRL does
    assert r["generation_tok_s"] == pytest.approx(r["generation_tokens"] / r["generation_s"])
    assert 0 <= r["reward"] <= 1
