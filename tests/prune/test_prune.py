"""Pruning: exact sparsity per row and N:M from every method, SparseGPT's update against magnitude/Wanda on a
layer's outputs, `brrr prune`'s directory in brrr and transformers, and the bad inputs."""
import json

import pytest
import torch
import transformers

import brrr
from brrr.kernels import AttnMeta
from brrr.prune.layerwise import prune_model
from brrr.prune.magnitude import magnitude_prune
from brrr.prune.mask import Pattern, is_n_m, keep_mask, parse_pattern
from brrr.prune.semi_structured import supports_semi_structured, swap_semi_structured
from brrr.prune.sparsegpt import sparsegpt_prune
from brrr.prune.wanda import InputNorms, wanda_prune
from brrr.quant.gptq import Hessian
from brrr.quant.linear import projections
from tests import hf_models
from tests.cli import refuses

GEN = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prune")
    hf_models.save(hf_models.build("llama-attn-bias", vocab_size=320), path)
    hf_models.save_tokenizer(path)
    return path


def correlated_inputs(n=512, dim=64):
    """Inputs with a few large features and correlated columns, as LLM activations have."""
    x = torch.randn(n, dim, generator=GEN) @ torch.randn(dim, dim, generator=GEN) / dim ** 0.5
    x[:, :4] *= 10
    return x


def test_keep_mask_is_exact_per_row_and_n_m():
    score = torch.rand(16, 64, generator=GEN)
    for s in (0.0, 0.3, 0.5, 0.9):
        keep = keep_mask(score, Pattern(s))
        assert (keep.sum(1) == 64 - round(s * 64)).all()
        kept_min = torch.where(keep, score, torch.inf).min(1).values
        pruned_max = torch.where(keep, -torch.inf, score).max(1).values
        assert (kept_min > pruned_max).all()  # the lowest scores of each row went
    for n, m in ((2, 4), (1, 4), (4, 8)):
        keep = keep_mask(score, parse_pattern(None, f"{n}:{m}"))
        assert (keep.view(16, -1, m).sum(-1) == n).all()


@pytest.mark.parametrize("spec", [(0.5, None), (0.7, None), (None, "2:4"), (None, "4:8")])
def test_every_method_hits_the_pattern_exactly(spec):
    w, x = torch.randn(48, 64, generator=GEN), correlated_inputs()
    pattern = parse_pattern(*spec)
    H, norms = Hessian(64), InputNorms(64)
    H.add(x)
    norms.add(x)
    for pruned in (magnitude_prune(w, pattern), wanda_prune(w, norms.norms(), pattern),
                   sparsegpt_prune(w, H.H, pattern)):
        if pattern.structured:
            assert is_n_m(pruned, pattern.n, pattern.m)
            assert ((pruned == 0).sum(1) == 64 * (pattern.m - pattern.n) // pattern.m).all()
        else:
            assert ((pruned == 0).sum(1) == round(pattern.sparsity * 64)).all()


def test_wanda_scores_are_magnitude_times_input_norm():
    w, x = torch.randn(8, 64, generator=GEN), correlated_inputs()
    norms = InputNorms(64)
    for part in x.split(100):  # accumulated in pieces, as calibration batches arrive
        norms.add(part)
    expected = keep_mask(w.abs() * x.norm(dim=0), Pattern(0.5))
    assert torch.equal(wanda_prune(w, norms.norms(), Pattern(0.5)) != 0, expected)


def test_sparsegpt_reconstructs_the_layer_output_best():
    """Its OBS update is what makes it beat the others on ||WX - W'X||; the no-update Wanda beats magnitude."""
    w, x = torch.randn(64, 64, generator=GEN), correlated_inputs()
    H, norms = Hessian(64), InputNorms(64)
    H.add(x)
    norms.add(x)
    for pattern in (Pattern(0.5), parse_pattern(None, "2:4")):
        err = {name: ((pruned - w) @ x.T).norm().item() for name, pruned in (
            ("magnitude", magnitude_prune(w, pattern)), ("wanda", wanda_prune(w, norms.norms(), pattern)),
            ("sparsegpt", sparsegpt_prune(w, H.H, pattern)))}
        assert err["sparsegpt"] < err["wanda"] < err["magnitude"], err


def test_prune_model_layer_by_layer(tiny_dir):
    calib = torch.randint(0, 256, (4, 32), generator=GEN)
    for method in ("magnitude", "wanda", "sparsegpt"):
        model = brrr.load(tiny_dir, dtype="float32", device="cpu").model
        config = prune_model(model, method, parse_pattern(None, "2:4"), calib)
        assert config["global_sparsity"] == 0.5 and config["sparsity_structure"] == "2:4"
        assert all(is_n_m(m.weight, 2, 4) for _, m in projections(model))
        assert (model.lm_head.weight != 0).all()  # embeddings and the head stay dense
    assert swap_semi_structured(model) == []  # on the CPU the 2:4 weights stay a dense nn.Linear
    assert not supports_semi_structured(torch.device("cpu"), torch.bfloat16, 4096, 4096)


def test_brrr_prune_writes_a_directory_brrr_and_transformers_load(tiny_dir, tmp_path, capsys):
    from brrr.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("def add(a, b):\n    return a + b\n" * 200)
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(tiny_dir), "--method", "sparsegpt", "--sparsity", "0.5", "--calib",
                 str(calib), "--calib-seq-len", "32", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["global_sparsity"] == 0.5
    assert json.loads((out / "config.json").read_text())["sparsity_config"]["method"] == "sparsegpt"
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (ref.model.layers[0].mlp.down_proj.weight == 0).float().mean() == 0.5
    pre = brrr.load(out, dtype="float32", device="cpu")
    ids = torch.tensor([3, 17, 42, 99, 5, 8])
    hidden = pre.model(ids, torch.arange(6), AttnMeta.causal([6], "cpu"))
    torch.testing.assert_close(pre.model.compute_logits(hidden), ref(ids[None]).logits[0], rtol=1e-4, atol=1e-4)
    assert pre.tokenizer.encode("def f():") == brrr.load(tiny_dir, device="cpu").tokenizer.encode("def f():")


def test_bad_input_is_named(tiny_dir, tmp_path, capsys):
    base = ["prune", "--model", str(tiny_dir), "--out", str(tmp_path / "o")]
    refuses(capsys, base + ["--method", "magnitude", "--sparsity", "1.5"], "--sparsity must be in [0, 1)")
    refuses(capsys, base + ["--method", "magnitude"], "pass --sparsity")
    refuses(capsys, base + ["--method", "magnitude", "--pattern", "2-4"], "--pattern must be N:M")
    refuses(capsys, base + ["--method", "magnitude", "--pattern", "4:2"], "0 < N < M")
    refuses(capsys, base + ["--method", "magnitude", "--pattern", "2:4", "--sparsity", "0.3"], "contradicts")
    refuses(capsys, base + ["--method", "wanda", "--sparsity", "0.5"], "needs calibration data")
    refuses(capsys, base + ["--method", "magnitude", "--pattern", "2:48"], "not a multiple of 48")


def test_eval_compare_shows_sparsity_beside_perplexity(tiny_dir, tmp_path, capsys):
    from brrr.cli import main

    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 100)
    pruned, quantized = tmp_path / "pruned", tmp_path / "pruned-int8"
    assert main(["prune", "--model", str(tiny_dir), "--method", "magnitude", "--pattern", "2:4",
                 "--out", str(pruned)]) == 0
    assert main(["quantize", "--model", str(pruned), "--method", "rtn-int8", "--out", str(quantized)]) == 0
    capsys.readouterr()
    report = tmp_path / "compare.json"
    assert main(["eval", "compare", "--models", str(tiny_dir), str(pruned), str(quantized), "--data", str(text),
                 "--window", "32", "--stride", "16", "--max-tokens", "256", "--json", str(report)]) == 0
    table = capsys.readouterr().out
    assert "sparsity" in table.splitlines()[0] and "magnitude 2:4" in table
    rows = json.loads(report.read_text())["rows"]
    assert [r["sparsity"] for r in rows] == [0.0, 0.5, 0.5]  # int8's zero is exact: the pruned zeros survive
    assert rows[1]["method"] == "magnitude 2:4" and rows[2]["method"] == "rtn-int8"
    assert rows[1]["ppl"] != rows[0]["ppl"]  # the pruned model is scored (random weights: no ordering)
