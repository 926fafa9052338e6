"""`brrr bench kernels` off a GPU: clear errors, no traceback (the numbers come from the H200, bench/results/)."""
import pytest
import torch

from brrr.cli import main


def test_unknown_op_is_named(capsys):
    assert main(["bench", "kernels", "--ops", "rms_norm,softmax"]) == 2
    assert "--ops: unknown op 'softmax'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_needs_a_gpu(capsys):
    assert main(["bench", "kernels", "--ops", "rms_norm"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
