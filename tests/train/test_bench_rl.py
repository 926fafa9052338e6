"""`brrr bench rl` on a tiny model for two GRPO steps: one record a step with the phase split, rollout tokens/s and
the run's machine, command and config; the phases fit inside the step's wall time; bad counts are refused."""
import json

import pytest

from brrr.cli import main
from tests.cli import refuses
from tests.hf_models import build, save, save_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tokenizer(save(build("llama3-rope", vocab_size=320), tmp_path_factory.mktemp("bench-rl") / "model"))


@pytest.mark.parametrize("invariant", [False, True])
def test_two_steps_write_one_record_each(tiny, tmp_path, capsys, invariant):
    """The invariant run is a LoRA policy too (--use-peft): adapters and the mode together, mismatch 0."""
    out = tmp_path / "rl.jsonl"
    argv = ["bench", "rl", "--model", str(tiny), "--num-prompts", "2", "--num-generations", "2",
            "--max-completion-length", "6", "--steps", "2", "--beta", "0.04", "--device", "cpu", "--json", str(out)]
    assert main(argv + ["--batch-invariant", "--use-peft"] * invariant) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records and [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["bench"] == "rl" and r["machine"] == "cpu" and r["device"] == "cpu" and r["weights"] == "loaded"
        assert r["command"].startswith("brrr bench rl --model ") and ("--batch-invariant" in r["command"]) == invariant
        assert r["config"]["num_prompts"] == 2 and r["config"]["num_generations"] == 2
        assert r["config"]["batch_invariant"] is invariant and r["config"]["max_completion_length"] == 6
        assert r["config"]["use_peft"] is invariant and ("LoRA r=16" in r["config"]["policy"]) == invariant
        assert r["config"]["dtype"] == "float32"  # the CPU's: bf16 is CUDA's default for a LoRA base
        for key in ("step_s", "rollout_s", "reference_logps_s", "train_s", "rollout_tokens", "rollout_tok_s"):
            assert r[key] > 0, key
        assert 4 <= r["rollout_tokens"] <= 2 * 2 * 6
        assert r["phases_s"] == pytest.approx(sum(r[k] for k in ("weight_sync_s", "wake_s", "rollout_s",
                                                                 "reference_logps_s", "train_s")))
        assert r["phases_s"] <= r["step_s"]
    assert records[1]["weight_sync_s"] > 0 and records[1]["wake_s"] > 0  # the first step's engine was awake
    if invariant:
        assert all(r["logprob_mismatch_max"] == 0.0 for r in records)


def test_counts_are_checked(capsys):
    refuses(capsys, ["bench", "rl", "--steps", "0"], "--steps must be >= 1, got 0")
    refuses(capsys, ["bench", "rl", "--num-generations", "1"], "--num-generations must be >= 2, got 1")
