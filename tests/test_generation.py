"""Reference generation end to end: the default model, sampling, the CLI, hub resolution."""
import subprocess
import sys

import pytest
import torch

import brrr
from brrr import BrrrError, SamplingParams
from brrr.hub import resolve_model
from brrr.engine.sampler import SampleRow, sample
from tests import hf_models


def test_default_model_generates_and_chats():
    pretrained = brrr.load()
    assert pretrained.config.architecture == "LlamaForCausalLM"
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    text = pretrained.generate("def fibonacci(n):", params)
    assert text == pretrained.generate("def fibonacci(n):", params)  # same seed, same text
    ids = list(pretrained.generate_ids([{"role": "user", "content": "hi"}], params))
    assert len(ids) == 16


def test_sampling_seed_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -5.0]])
    draws = lambda p: {sample(logits, [SampleRow(p, seed=s)]).tokens[0] for s in range(300)}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # softmax = [.66, .24, .09, .004, ...]: top_p 0.85 keeps tokens 0 and 1 (0.66 < 0.85 <= 0.90)
    assert draws(SamplingParams(temperature=1.0, top_p=0.85)) == {0, 1}
    assert draws(SamplingParams(temperature=0)) == {0}
    assert draws(SamplingParams(temperature=1.0)) >= {0, 1, 2}


def test_stop_tokens_end_generation(tmp_path):
    hf_models.save(hf_models.build("llama3-rope"), tmp_path)
    model = brrr.load_model(tmp_path)
    greedy = list(brrr.generate_tokens(model, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0)))
    stopped = list(brrr.generate_tokens(model, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0,
                                                                         stop_token_ids=[greedy[2]])))
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]
    assert list(brrr.generate_tokens(model, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0),
                                     eos_token_ids=(greedy[0],))) == greedy[:1]


def test_cli_generate_and_chat():
    gen = subprocess.run([sys.executable, "-m", "brrr", "generate", "def f(x):", "--max-tokens", "12", "--seed", "0",
                          "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def f(x):") and "12 tokens in" in gen.stderr and "tok/s" in gen.stderr
    chat = subprocess.run([sys.executable, "-m", "brrr", "chat", "--max-tokens", "5", "--seed", "0"],
                          input="hello\n/reset\nagain\n/exit\n", capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("assistant> ") == 2
    version = subprocess.run([sys.executable, "-m", "brrr", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"brrr {brrr.__version__}"


def test_hub_id_offline_gives_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(BrrrError, match="could not get 'no-such-org/no-such-model' from the Hugging Face hub"):
        resolve_model("no-such-org/no-such-model")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_cli_generate_runs_a_prompts_file_through_the_engine(tmp_path):
    import json

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nimport os\nclass A:\n")
    run = subprocess.run([sys.executable, "-m", "brrr", "generate", str(prompts), "--max-tokens", "6", "--seed", "0",
                          "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "import os", "class A:"]
    assert all(r["output_tokens"] == 6 and r["finish_reason"] == "length" for r in rows)
    assert "3 request(s), 18 tokens" in run.stderr
