"""`brrr bench kernels` off a GPU: clear errors, no traceback (the numbers come from the H200, bench/results/)."""
import pytest
import torch

from brrr.cli import main
from tests.cli import refuses


def test_unknown_op_is_named(capsys):
    refuses(capsys, ["bench", "kernels", "--ops", "rms_norm,softmax"], "--ops: unknown op 'softmax'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_needs_a_gpu(capsys):
    refuses(capsys, ["bench", "kernels", "--ops", "rms_norm"], "needs a CUDA GPU")


def test_replot_from_records(tmp_path):
    """--replot draws an earlier run's roofline from its records alone (no GPU)."""
    import json

    pytest.importorskip("matplotlib")
    machine = {"gpu": "NVIDIA H200", "copy_bandwidth": 4.27e12, "bf16_matmul_flops": 7.9e14, "torch": "2.11",
               "triton": "3.6"}
    records = [{"bench": "kernels", "op": "RMSNorm 16x4096", "flops": 262144, "bytes": 270336,
                "triton": {"time_s": 1e-7}, "machine": machine},
               {"bench": "kernels", "op": "decode attention", "sweep": {"splits": 1}, "time_s": 1e-5}]
    path = tmp_path / "k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["bench", "kernels", "--replot", str(path), "--plot", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert main(["bench", "kernels", "--replot", str(path)]) == 2  # where to draw it is required
