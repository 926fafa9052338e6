"""`torchrun --nproc_per_node 2 -m brrr train`: a bad layout is one error from rank 0 and every rank exits; a
SIGTERM (what torchrun and schedulers send before a kill) writes a DCP checkpoint at one step on every rank, and
the run resumes from it (here on one process) on the uninterrupted loss curve."""
import json
import signal
import time

import pytest

from brrr.train.trainer import TrainConfig, Trainer
from tests.train.distributed_helpers import REPO, torchrun, train_losses

LOSS_ATOL = 5e-5


def _flags(tiny_config, data_dir, out, **kw):
    base = {"--config": tiny_config, "--data": data_dir, "--out": out, "--device": "cpu", "--seq-len": 32,
            "--micro-batch": 4, "--max-steps": 300, "--lr": 3e-3, "--warmup-steps": 2, "--log-every": 1,
            "--eval-every": 1000, "--checkpoint-every": 1000, **kw}
    return [str(x) for kv in base.items() for x in kv]


def test_a_bad_layout_is_one_error_on_rank_0_and_every_rank_exits(tiny_config, data_dir, tmp_path):
    proc = torchrun(2, _flags(tiny_config, data_dir, tmp_path / "out", **{"--tp": 3}))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    message = "brrr: error: --dp-replicate 1 x --tp 3 x --pp 1 = 3 does not divide the world size 2"
    assert err.count(message) == 1, err
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_a_rank_failing_inside_a_step_ends_the_run_with_its_error(tiny_config, data_dir, tmp_path):
    """The failed rank prints its traceback and exits at once (destroy_process_group would wait on its peers' pending
    collectives under NCCL); torchrun then stops the rank still waiting in the step's gradient reduction."""
    start = time.monotonic()
    script = str(REPO / "tests" / "train" / "rank_fails.py")
    proc = torchrun(2, _flags(tiny_config, data_dir, tmp_path / "out"), entry=(script,))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 failed inside its step" in err, err[-3000:]
    assert time.monotonic() - start < 150


def test_sigterm_writes_a_checkpoint_and_the_run_resumes_from_it(tiny_config, data_dir, tmp_path):
    out = tmp_path / "out"
    proc = torchrun(2, _flags(tiny_config, data_dir, out))
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    printed, err = proc.communicate(timeout=120)
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    assert steps and all(" tok/s (" in line and "/rank) |" in line for line in steps), printed  # CPU ranks, no GPU
    stopped = json.loads((out / "checkpoint" / "dcp" / "trainer.json").read_text())["step"]
    assert stopped >= 3
    assert f"interrupted: checkpoint of step {stopped} written to {out / 'checkpoint' / 'dcp'}" in err
    assert err.count("SIGTERM: stopping after this step") == 1  # rank 0 says it, both ranks did it
    assert len(train_losses(out)) == stopped  # no step logged past the checkpoint

    common = dict(device="cpu", seq_len=32, micro_batch=8, max_steps=300, lr=3e-3, warmup_steps=2, log_every=1,
                  eval_every=1000, checkpoint_every=1000, final_eval_windows=2, stop_at=stopped + 2)
    Trainer(TrainConfig(str(tiny_config), str(data_dir), str(out), resume=True, **common)).run()
    reference = tmp_path / "uninterrupted"
    Trainer(TrainConfig(str(tiny_config), str(data_dir), str(reference), **common)).run()
    assert len(train_losses(out)) == stopped + 2
    assert train_losses(out) == pytest.approx(train_losses(reference), abs=LOSS_ATOL)
