import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from brrr.cli import main
from brrr.engine import LLM
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.quant.checkpoint import save_quantized
from brrr.quant.linear import QuantLinear, projections
from brrr.quant.methods import quantize_model, rtn_tensors
from brrr.sampling_params import SamplingParams
from tests import hf_models


def _logits(model, ids):
    return model.compute_logits(model(ids, torch.arange(len(ids)), AttnMeta.causal([len(ids)], "cpu")))


@pytest.fixture(scope="module")
def quantized_dirs(tiny_dir, calib, tmp_path_factory):
    out = {}
    for method in ("rtn-int8", "gptq", "nf4", "fp8", "smoothquant", "fp8-w8a8"):
        model = load_model(tiny_dir, dtype=torch.float32)
        config = quantize_model(model, method, group_size=32, calib=calib)
        path = tmp_path_factory.mktemp(method)
        save_quantized(model, config, path, source_dir=tiny_dir)
        out[method] = (path, model)
    return out


@pytest.mark.parametrize("method", ["rtn-int8", "gptq", "nf4", "fp8", "smoothquant", "fp8-w8a8"])
@torch.no_grad()
def test_a_saved_quantized_checkpoint_loads_into_the_same_model(quantized_dirs, method):
    path, model = quantized_dirs[method]
    assert json.loads((path / "config.json").read_text())["quantization_config"]["method"] == method
    loaded = load_model(path, dtype=torch.float32)
    assert all(isinstance(m, QuantLinear) for _, m in projections(loaded))
    ids = torch.arange(1, 40)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize("method", ["gptq", "smoothquant", "fp8-w8a8"])
def test_a_quantized_tiny_model_generates_through_the_engine(quantized_dirs, method):
    path, model = quantized_dirs[method]
    llm = LLM(str(path), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    ids = [5, 6, 7, 8]
    with torch.no_grad():  # greedy tokens from the in-memory quantized model, one full forward per token
        for _ in range(8):
            ids.append(int(_logits(model, torch.tensor(ids))[-1].argmax()))
    assert list(out.outputs[0].token_ids) == ids[4:]


def _rewrite(src, dst, config_edit=None, tensor_edit=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if tensor_edit:
        tensor_edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_long_work_shows_progress_on_stderr(tiny_dir, tmp_path, capsys):
    """GPTQ and AWQ advance per projection (AWQ's scale search per layer first), eval per window, each bar on
    stderr, so stdout stays the result."""
    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    model = load_model(tiny_dir)
    n_proj, n_layers = len(projections(model)), model.config.num_layers
    for method, done in (("gptq", n_proj), ("awq", n_layers + n_proj)):
        assert main(["quantize", "--model", str(tiny_dir), "--method", method, "--group-size", "32", "--calib",
                     str(text), "--calib-seq-len", "32", "--calib-samples", "4", "--out", str(tmp_path / method)]) == 0
        out, err = capsys.readouterr()
        assert re.search(rf"^{method} .* {done}/{done} .* left ", err, re.M), err
        assert json.loads(out)["method"] == method
    assert main(["eval", "compare", "--models", str(tiny_dir), str(tmp_path / "gptq"), "--data", str(text),
                 "--window", "64", "--stride", "32"]) == 0
    out, err = capsys.readouterr()
    assert re.search(rf"^ppl 1/2 {tiny_dir.name} .* left ", err, re.M) and re.search(r"^ppl 2/2 gptq ", err, re.M)
    assert "ppl" in out and "left" not in out


def test_a_checkpoint_whose_quantization_config_disagrees_with_its_tensors_is_a_clear_error(quantized_dirs, tmp_path):
    gptq, int8 = quantized_dirs["gptq"][0], quantized_dirs["rtn-int8"][0]
    bad = _rewrite(gptq, tmp_path / "group", lambda qc: qc.update(group_size=64))
    with pytest.raises(BrrrError, match="group_size 64 implies 1"):
        load_model(bad)
    bad = _rewrite(int8, tmp_path / "fmt", lambda qc: qc.update(format="int4", group_size=32))
    with pytest.raises(BrrrError, match="lacks tensors zeros"):
        load_model(bad)
    bad = _rewrite(gptq, tmp_path / "missing",
                   tensor_edit=lambda t: t.pop("model.layers.1.mlp.down_proj.scales"))
    with pytest.raises(BrrrError, match="model.layers.1.mlp.down_proj lacks tensors scales"):
        load_model(bad)
    bad = _rewrite(gptq, tmp_path / "method", lambda qc: qc.update(quant_method="bitnet"))
    with pytest.raises(BrrrError, match="quant_method 'bitnet' is not supported"):
        load_model(bad)


def test_cli_quantize_and_eval(tiny_dir, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    assert main(["quantize", "--model", str(tiny_dir), "--method", "awq", "--group-size", "32", "--calib", str(text),
                 "--calib-seq-len", "32", "--calib-samples", "8", "--out", str(tmp_path / "awq")]) == 0
    assert main(["quantize", "--model", str(tiny_dir), "--method", "gptq", "--out", str(tmp_path / "x")]) == 2
    assert "needs calibration data" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(tmp_path / "awq"), "--data", str(text), "--window", "64",
                 "--stride", "32"]) == 0
    ppl = json.loads(capsys.readouterr().out)["ppl"]
    assert main(["eval", "compare", "--models", str(tiny_dir), str(tmp_path / "awq"), "--data", str(text),
                 "--window", "64", "--stride", "32"]) == 0
    table = capsys.readouterr().out
    assert "awq" in table and f"{ppl:.4f}" in table


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from brrr.train.data import build
    from tests.train.conftest import write_sources

    root = tmp_path_factory.mktemp("calib-data")
    write_sources(root / "src", files=12)
    build(root / "data", [str(root / "src")], vocab=300, val_fraction=0.2, show_progress=False)
    return root / "data"


def test_calibration_from_a_brrr_data_directory_reads_its_memmapped_train_split(tiny_dir, data_dir, tmp_path,
                                                                                capsys):
    from brrr.quant.calib import calibration_tokens
    from brrr.token_data import TokenData

    model = tmp_path / "model"  # the tiny model with the data's tokenizer, as `brrr train --data` would export it
    model.mkdir()
    for f in tiny_dir.iterdir():
        shutil.copy(data_dir / f.name if f.name.startswith("tokenizer") else f, model / f.name)
    train = TokenData(data_dir).splits["train"]
    seqs = calibration_tokens(data_dir, tokenizer=None, n_samples=4, seq_len=32)
    assert seqs.shape == (4, 32) and seqs.flatten().tolist() == train[:128].tolist()
    assert main(["quantize", "--model", str(model), "--method", "gptq", "--group-size", "32",
                 "--calib", str(data_dir), "--calib-seq-len", "32", "--calib-samples", "4",
                 "--out", str(tmp_path / "q")]) == 0
    assert main(["eval", "ppl", "--model", str(tmp_path / "q"), "--data", str(data_dir),
                 "--window", "64", "--stride", "32"]) == 0  # the val split
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] == len(TokenData(data_dir)
                                                                                   .splits["val"]) - 1
    with pytest.raises(BrrrError, match="fewer than one calibration sequence"):
        calibration_tokens(data_dir, None, seq_len=10 ** 7)


@pytest.mark.parametrize("command", [
    ["quantize", "--method", "gptq", "--calib", "{data}", "--out", "{tmp}/q"],
    ["eval", "ppl", "--data", "{data}"],
    ["eval", "compare", "--models", "{default}", "--data", "{data}"]])
def test_token_files_of_another_tokenizer_are_refused(data_dir, tmp_path, capsys, command):
    """README's flow: a fresh `brrr data build` trains its own BPE, which is not the shipped default model's; its
    ids would be read as other tokens (perplexity in the thousands, GPTQ calibrated on noise)."""
    from brrr.default_model import default_model_dir

    args = [a.format(data=data_dir, tmp=tmp_path, default=default_model_dir()) for a in command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{data_dir} holds token ids of its own tokenizer" in err and "Pass a text file instead" in err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("method", ["rtn-int4", "rtn-int8", "nf4", "gptq"])
@torch.no_grad()
def test_a_quantized_lm_head_is_its_rtn_weight_and_survives_save_and_load(tiny_dir, calib, tmp_path, method):
    """`--lm-head`: the output projection becomes a QuantLinear holding the round-to-nearest of the float head (in
    the method's format, whatever the method does to the layers), computes with that weight, and loads back."""
    model, ref = load_model(tiny_dir, dtype=torch.float32), load_model(tiny_dir, dtype=torch.float32)
    config = quantize_model(model, method, group_size=32, calib=calib, lm_head=True)
    assert config["lm_head"] is True and isinstance(model.lm_head, QuantLinear)
    want = rtn_tensors(config["format"], ref.lm_head.weight, 32, False)
    assert all(torch.equal(model.lm_head.checkpoint_tensors()[k], v) for k, v in want.items())
    ids = torch.arange(1, 40)
    hidden = model(ids, torch.arange(len(ids)), AttnMeta.causal([len(ids)], "cpu"))
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.lm_head.dequantize().T)
    save_quantized(model, config, tmp_path, source_dir=tiny_dir)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(loaded.lm_head, QuantLinear)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids))


def test_lm_head_quantization_refuses_a_tied_head_and_the_w8a8_methods(tiny_dir, calib, tmp_path):
    tied = hf_models.save(hf_models.build("tied"), tmp_path)
    with pytest.raises(BrrrError, match="tie_word_embeddings"):
        quantize_model(load_model(tied, dtype=torch.float32), "rtn-int8", lm_head=True)
    with pytest.raises(BrrrError, match="activations"):
        quantize_model(load_model(tiny_dir, dtype=torch.float32), "smoothquant", calib=calib, lm_head=True)


def test_cli_quantize_lm_head(tiny_dir, tmp_path, capsys):
    assert main(["quantize", "--model", str(tiny_dir), "--method", "rtn-int4", "--group-size", "32", "--lm-head",
                 "--out", str(tmp_path / "q")]) == 0
    assert json.loads(capsys.readouterr().out)["lm_head"] is True
    assert isinstance(load_model(tmp_path / "q", dtype=torch.float32).lm_head, QuantLinear)


def test_quantized_directory_keeps_a_chat_template_saved_in_its_own_file(tmp_path):
    """transformers 5 writes the chat template to chat_template.jinja: a quantized copy must keep it."""
    from brrr.tokenizer import Tokenizer

    src = hf_models.save(hf_models.build("llama3-rope"), tmp_path / "src")
    hf_models.save_tokenizer(src, chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    if not (src / "chat_template.jinja").is_file():  # an older transformers kept it in tokenizer_config.json
        (src / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    model = load_model(src, dtype=torch.float32)
    save_quantized(model, quantize_model(model, "rtn-int8"), tmp_path / "q", source_dir=src)
    text = Tokenizer.from_dir(tmp_path / "q").apply_chat_template([{"role": "user", "content": "hi"}],
                                                                  add_generation_prompt=False)
    assert text == "<user>hi"
