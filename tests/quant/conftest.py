import pytest
import torch

from tests import hf_models


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama with biases and no GQA (so AWQ also folds v_proj -> o_proj), with a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-quant")
    hf_models.save(hf_models.build("llama-attn-bias", num_key_value_heads=4, vocab_size=320), path)
    hf_models.save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def calib():
    """Calibration token ids for the tiny model (vocab 256)."""
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
