import os

import pytest
import torch

# One intra-op thread: on small CI machines (2 cores) more threads make the tiny test models ~10x slower. Through
# OMP_NUM_THREADS, brrr's thread policy (brrr/threads.py) keeps to it in LLM(), the CLI and spawned servers too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter (tests/kernels). `triton.jit` reads this when a
    # kernel is defined, so it must be set before any test module imports brrr.kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Each test its own BRRR_CACHE_DIR: on a GPU the quantized matmuls' tuned picks are written there
    (brrr/kernels/quant/tune.py), and a test that tunes must not find an earlier test's picks."""
    monkeypatch.setenv("BRRR_CACHE_DIR", str(tmp_path / "brrr-cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
