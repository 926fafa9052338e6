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


def test_cli_quantize_on_a_device_and_compare_writes_json_in_either_dtype(tiny_dir, tmp_path, capsys):
    """`brrr quantize --device` loads and quantizes where asked (here the CPU, the one device the tests have);
    `brrr eval compare --json` writes the settings and the printed rows; `--dtype bfloat16` evaluates in bf16."""
    import json

    from brrr.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    assert main(["quantize", "--model", str(tiny_dir), "--method", "smoothquant", "--calib", str(text),
                 "--calib-seq-len", "32", "--calib-samples", "8", "--device", "cpu",
                 "--out", str(tmp_path / "sq")]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "smoothquant"
    rows = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"compare-{dtype}.json"
        assert main(["eval", "compare", "--models", str(tiny_dir), str(tmp_path / "sq"), "--data", str(text),
                     "--window", "64", "--stride", "32", "--max-tokens", "300", "--dtype", dtype,
                     "--json", str(out)]) == 0
        saved = json.loads(out.read_text())
        assert saved["dtype"] == dtype and saved["max_tokens"] == 300 and saved["window"] == 64
        assert [r["method"] for r in saved["rows"]] == ["none", "smoothquant"]
        assert saved["rows"][0]["delta_pct"] == 0 and saved["rows"][1]["tokens"] == 299
        assert f"{saved['rows'][1]['ppl']:.4f}" in capsys.readouterr().out
        rows[dtype] = saved["rows"]
    for a, b in zip(rows["float32"], rows["bfloat16"]):  # the same models, rounded differently
        assert b["ppl"] == pytest.approx(a["ppl"], rel=0.05)
    assert main(["eval", "ppl", "--model", str(tmp_path / "sq"), "--data", str(text), "--window", "64",
                 "--stride", "32", "--max-tokens", "300", "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == pytest.approx(rows["bfloat16"][1]["ppl"], rel=1e-6)
