"""`brrr bench train`: under torchrun (here two CPU processes) rank 0 writes one record for the layout; alone it
measures a GPU, and refuses layout flags that only torchrun can honour."""
import json

import pytest
import torch

from tests.cli import refuses
from tests.train.conftest import TINY_MODEL
from tests.train.distributed_helpers import torchrun


def test_under_torchrun_rank_0_writes_the_layouts_record(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_MODEL, "vocab_size": 256}))
    out = tmp_path / "train.jsonl"
    proc = torchrun(2, ["--model", str(config), "--micro-batch", "2", "--seq-len", "16", "--steps", "2", "--warmup",
                        "1", "--out", str(out), "--profile", str(tmp_path / "prof")], command=("bench", "train"))
    stdout, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in stdout.splitlines() if line.startswith("{")] == [record]
    assert record["bench"] == "train_distributed" and record["gpus"] == 2 and record["dp_shard"] == 2
    assert record["tokens_per_step"] == 2 * 16 * 2 and record["tokens_per_s"] > 0 and record["final_loss"] > 0
    assert record["micro_batch_per_rank"] == 2 and record["seq_len"] == 16 and record["mfu"] is None  # CPU
    # --profile: each rank's chrome trace and its top-20 table (CPU ops here, GPU kernels on CUDA); rank 0's printed
    for rank in (0, 1):
        trace = json.loads((tmp_path / "prof" / f"rank{rank}.trace.json").read_text())
        assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"])
        table = (tmp_path / "prof" / f"rank{rank}.kernels.txt").read_text().splitlines()
        assert table[0].startswith(f"rank{rank} (profiled step ") and "top 20 CPU ops by total time" in table[0]
        assert len(table) == 2 + 20
    assert "rank0 (profiled step " in stdout and "rank1 (profiled step " not in stdout


def test_alone_layout_flags_need_torchrun_and_counts_are_checked(capsys):
    refuses(capsys, ["bench", "train", "--model", "llama-3.2-1b", "--tp", "2"], "--tp set a multi-GPU layout: launch with torchrun")
    refuses(capsys, ["bench", "train", "--steps", "0"], "--steps must be >= 1, got 0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="alone, bench train measures the GPU")
def test_alone_on_cpu_it_says_it_measures_a_gpu(capsys):
    refuses(capsys, ["bench", "train", "--model", "smollm2-135m:x"], "the micro-batch after ':' must be a positive integer")
    refuses(capsys, ["bench", "train", "--model", "smollm2-135m:2"], "torch sees no CUDA device")


def test_profile_overlap_line_splits_a_step_into_compute_exposed_nccl_and_idle():
    from brrr.bench.train_profile import overlap_line

    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    # compute 0-400 and 500-900 us; NCCL 300-600 (100 us of it alone) and 950-1000 (alone); idle 900-950
    events = [k("gemm", 0, 400), k("gemm", 500, 400), k("ncclDevKernel_AllGather", 300, 300),
              k("ncclDevKernel_ReduceScatter", 950, 50), {"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 9}]
    assert overlap_line(events) == ("GPU span 1.0 ms: compute 0.8 ms, NCCL 0.3 ms (0.1 ms of it under no "
                                    "compute), idle 0.1 ms")
    assert overlap_line([]) == "no GPU kernels in the profiled step"


def test_under_torchrun_a_pipeline_layout_records_its_bubble(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_MODEL, "vocab_size": 256}))
    out = tmp_path / "train.jsonl"
    proc = torchrun(2, ["--model", str(config), "--micro-batch", "4", "--seq-len", "16", "--steps", "2", "--warmup",
                        "1", "--pp", "2", "--microbatches", "4", "--out", str(out)], command=("bench", "train"))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["layout"] == "pp 2" and record["pp"] == 2 and record["pp_schedule"] == "1f1b"
    assert record["microbatches"] == 4 and record["pp_bubble_formula"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert 0 < record["pp_bubble"] < 1 and record["pp_stage_imbalance"] >= 1 and record["final_loss"] > 0
