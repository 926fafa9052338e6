"""Bad input raises a BrrrError naming the problem; the CLI prints it and exits 2 without a traceback."""
import json
import subprocess
import sys

import pytest
import torch

from brrr import BrrrError, ModelConfig, SamplingParams, generate_tokens, load_model
from tests import hf_models

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_models.save_tokenizer(path)
    return hf_models.save(hf_models.build("tied", max_position_embeddings=32, vocab_size=320), path)


@pytest.mark.parametrize("patch, message", [
    ({"hidden_size": "64"}, "field 'hidden_size' must be int, got str"),
    ({"num_hidden_layers": None}, "required field 'num_hidden_layers' is missing"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' must be > 0"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads' \\(3\\) must divide num_attention_heads \\(4\\)"),
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel', which brrr does not support"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling.low_freq_factor' is required"),
    ({"rope_scaling": {"rope_type": "su"}}, "rope_type' is 'su'"),
    ({"eos_token_id": "2"}, "field 'eos_token_id' must be an int or a list"),
    ({"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be bool"),
])
def test_malformed_config_names_the_field(patch, message):
    with pytest.raises(BrrrError, match=message):
        ModelConfig.from_hf({**BASE, **patch})


def test_config_parses_both_rope_formats():
    old = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert old.rope == new.rope and old.rope.theta == 5e5 and old.rope.params == {"factor": 2.0}


def test_missing_weights_and_missing_dir(tmp_path):
    with pytest.raises(BrrrError, match="model directory not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(BrrrError, match="no \\*.safetensors weights"):
        load_model(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(BrrrError, match="config.json not found"):
        load_model(tmp_path)


def test_truncated_safetensors_is_named(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(BrrrError, match="model.safetensors.*truncated or corrupt"):
        load_model(tmp_path)


def test_checkpoint_missing_a_tensor_is_named(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(BrrrError, match="missing tensors: model.layers.1.mlp.down_proj.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(model_dir, tmp_path):
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BrrrError, match="mlp.*_proj.weight' has shape .*, the config implies .*96"):
        load_model(tmp_path)


def test_prompt_longer_than_context(model_dir):
    model = load_model(model_dir)
    with pytest.raises(BrrrError, match="prompt has 40 tokens; the model's context .* is 32"):
        list(generate_tokens(model, [1] * 40, SamplingParams(max_tokens=4)))
    with pytest.raises(BrrrError, match="token id 999 is outside the vocabulary \\[0, 320\\)"):
        list(generate_tokens(model, [1, 999], SamplingParams(max_tokens=4)))


def test_generation_stops_at_context_limit(model_dir):
    model = load_model(model_dir)
    out = list(generate_tokens(model, [1] * 30, SamplingParams(max_tokens=10, temperature=0)))
    assert len(out) == 2


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be >= 1"), ("temperature", -1.0, "temperature must be in \\[0, 100\\]"),
    ("top_p", 0.0, "top_p must be in \\(0, 1\\]"), ("top_k", -2, "top_k must be >= 0"),
    ("max_tokens", "10", "max_tokens must be an integer"),
    ("temperature", float("nan"), "temperature must be in"), ("top_p", float("nan"), "top_p must be in"),
    ("min_p", float("nan"), "min_p must be in"), ("repetition_penalty", float("nan"), "repetition_penalty must be"),
    ("presence_penalty", float("nan"), "presence_penalty must be"),
    ("frequency_penalty", float("inf"), "frequency_penalty must be"), ("temperature", float("inf"), "temperature"),
])
def test_sampling_params_validation(field, value, message):
    with pytest.raises(BrrrError, match=message):
        SamplingParams(**{field: value})


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "brrr", *args], capture_output=True, text=True, input=stdin, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--model", "/does/not/exist"], "model directory not found"),
    (["generate", "hi", "--temperature", "-3"], "--temperature must be in"),
    (["generate", "hi", "--temperature", "nan"], "--temperature must be in [0, 100], got nan"),
    (["generate", "hi", "--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["generate", "hi", "--device", "tpu"], "--device 'tpu' is not a device"),
    (["chat", "--device", "tpu"], "--device 'tpu' is not a device"),
    (["generate", "hi", "--device", "cuda:99"], "--device cuda:99:"),
    (["serve", "--device", "tpu"], "--device 'tpu' is not a device"),
    (["generate", "hi", "--dtype", "int3"], "dtype must be one of"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_cuda_on_a_cpu_only_torch_is_one_line(command):
    result = _cli(*command, "--device", "cuda")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "brrr: error: --device cuda: this torch is built without CUDA; use --device cpu (or install a CUDA build of "
        "torch)"]


def test_a_refused_prompt_is_not_echoed(model_dir):
    """The error goes to stderr alone: stdout does not start the echo of a prompt that is then refused."""
    result = _cli("generate", "hello", "--model", str(model_dir), "--max-tokens", "2000")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("brrr: error: prompt (") and "the model's context" in result.stderr


def test_prompts_file_names_the_line_that_does_not_fit(model_dir, tmp_path):
    """Every line is checked before any is generated; the first that does not fit fails the run, named."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f():\n\nimport os\n" + "x " * 100 + "\nclass A:\n")
    result = _cli("generate", str(prompts), "--model", str(model_dir), "--max-tokens", "2")
    assert result.returncode == 2 and result.stdout == ""
    assert f"{prompts} line 4: prompt (" in result.stderr and "Traceback" not in result.stderr


def test_chat_warns_that_the_default_model_is_not_chat_tuned(model_dir):
    default = _cli("chat", "--max-tokens", "2", stdin="/exit\n")
    assert default.returncode == 0 and "warning: brrr's small default model" in default.stderr
    assert "not chat-tuned" in default.stderr
    named = _cli("chat", "--model", str(model_dir), "--max-tokens", "2", stdin="/exit\n")
    assert named.returncode == 0 and "not chat-tuned" not in named.stderr


def test_cli_truncated_checkpoint_and_long_prompt(model_dir, tmp_path):
    result = _cli("generate", "x " * 100, "--model", str(model_dir))
    assert result.returncode == 2 and "the model's context" in result.stderr and "Traceback" not in result.stderr
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes()[:100] if f.suffix == ".safetensors" else f.read_bytes())
    result = _cli("generate", "hi", "--model", str(tmp_path))
    assert result.returncode == 2 and "truncated or corrupt" in result.stderr and "Traceback" not in result.stderr
