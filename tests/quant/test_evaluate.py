import math

import pytest
import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.quant.evaluate import perplexity, windows


@pytest.mark.parametrize("n,window,stride", [(1000, 512, 256), (100, 32, 31), (77, 16, 5), (10, 64, 32)])
def test_windows_score_every_token_after_the_first_exactly_once(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert end - begin <= window and begin < first <= end
        scored += range(first, end)
    assert scored == list(range(1, n))


@torch.no_grad()
def test_perplexity_with_one_window_equals_the_full_sequence_cross_entropy(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.float32)
    tokens = torch.randint(0, 320, (200,), generator=torch.Generator().manual_seed(3))
    logits = model.compute_logits(model(tokens, torch.arange(200), AttnMeta.causal([200], "cpu")))
    nll = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:]).item()
    result = perplexity(model, tokens, window=256, stride=128)
    assert result["tokens"] == 199
    assert result["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    # sliding windows give a different (shorter-context) number, but over the same 199 tokens, batched or not
    a, b = perplexity(model, tokens, 64, 32, batch=8), perplexity(model, tokens, 64, 32, batch=1)
    assert a["tokens"] == 199 and a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)


def test_bad_windows_are_clear_errors(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.float32)
    with pytest.raises(BrrrError, match="--stride must be in"):
        perplexity(model, torch.arange(50), window=16, stride=16)
    with pytest.raises(BrrrError, match="exceeds the model's max_position_embeddings"):
        perplexity(model, torch.arange(50), window=4096)
