"""`brrr train` under torchrun on 2 GPUs (NCCL, FSDP2's bf16 policy): FSDP2, FSDP2 as ZeRO-2, TP, PP and CP (ring attention over NCCL P2P) follow
one GPU's loss curve (bf16 autocast) within bf16 tolerance, and a TP run resumes an FSDP run's DCP checkpoint.
Needs 2 GPUs (skipped on one)."""
import json

import pytest
import torch

from brrr.train.data import build
from tests.train.conftest import TINY_MODEL, write_sources
from tests.train.distributed_helpers import torchrun, train_losses

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

BF16_LOSS_ATOL = 0.05  # bf16 matmuls summed in other orders (TP splits each dot product over 2 GPUs)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-dist")
    write_sources(root / "src")
    build(root / "data", [str(root / "src")], vocab=400, val_fraction=0.2, show_progress=False)
    (root / "config.json").write_text(json.dumps({**TINY_MODEL, "num_hidden_layers": 4}))
    return root


def _train(root, world, out, *flags):
    args = ["--config", root / "config.json", "--data", root / "data", "--out", root / out, "--seq-len", 64,
            "--max-steps", 20, "--lr", 3e-3, "--warmup-steps", 2, "--log-every", 1, "--eval-every", 100,
            "--checkpoint-every", 100, "--final-eval-windows", 4, *flags]
    proc = torchrun(world, [str(a) for a in args])
    out_text, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return train_losses(root / out)


@pytest.mark.parametrize("flags", [["--micro-batch", 4], ["--micro-batch", 4, "--no-reshard-after-forward"],
                                   ["--micro-batch", 8, "--tp", 2], ["--micro-batch", 8, "--pp", 2],
                                   ["--micro-batch", 8, "--cp", 2]],
                         ids=["fsdp", "zero2", "tp", "pp", "cp"])
def test_two_gpus_follow_one(root, flags):
    one = root / "one" / "train_log.jsonl"
    reference = train_losses(root / "one") if one.exists() else _train(root, 1, "one", "--micro-batch", 8)
    name = "two_" + "_".join(str(f).strip("-") for f in flags)
    assert _train(root, 2, name, *flags) == pytest.approx(reference, abs=BF16_LOSS_ATOL)


def test_fsdp_checkpoint_resumes_as_tp_on_nccl(root):
    reference = train_losses(root / "one") if (root / "one").exists() else _train(root, 1, "one", "--micro-batch", 8)
    _train(root, 2, "trip", "--micro-batch", 4, "--stop-at", 10)
    losses = _train(root, 2, "trip", "--micro-batch", 8, "--tp", 2, "--resume")
    assert losses == pytest.approx(reference, abs=BF16_LOSS_ATOL)
    assert (root / "trip" / "model.safetensors").exists()
