"""The trained default model brrr ships: its files, its load time, its Python, and transformers' agreement."""
import ast
import json
import time

import pytest
import torch

import brrr
from brrr import SamplingParams
from brrr.default_model import DEFAULT_MODEL_DIR, default_model_dir
from brrr.hub import resolve_model

PROMPTS = ["def fibonacci(n):", "def is_prime(n):", "class Stack:", "import os\n\ndef list_python_files(root):",
           "def read_json(path):", "def factorial(n):", "class Point:\n    def __init__(self, x, y):",
           "def binary_search(items, target):", "for i in range(10):", "def main():"]


def generated_block(prompt: str, completion: str) -> str:
    """The block the prompt opens: its lines, then the completion's complete lines up to the first one that
    starts a new top-level statement (column 0). An unfinished last line (no newline yet) is dropped."""
    lines = (prompt + completion).split("\n")
    keep = prompt.count("\n") + 1
    block = lines[:keep]
    for line in lines[keep:-1]:
        if line[:1] and not line[:1].isspace():
            break
        block.append(line)
    return "\n".join(block) + "\n"


def parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


def test_the_shipped_files_are_the_default_and_fit_the_limits():
    assert resolve_model(None) == default_model_dir() == DEFAULT_MODEL_DIR
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["max_position_embeddings"] >= 512
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= 15_000_000


def test_loads_on_cpu_in_under_5_seconds():
    start = time.perf_counter()
    pretrained = brrr.load(device="cpu")
    seconds = time.perf_counter() - start
    assert seconds < 5, f"default model took {seconds:.2f} s to load"
    assert pretrained.config.vocab_size == pretrained.tokenizer.vocab_size == 8192


def test_generated_block_extraction():
    assert generated_block("def f(x):", "\n    return x\n\n\ndef g(") == "def f(x):\n    return x\n\n\n"
    assert generated_block("def f(x):", "\n    if x:\n        return 1\n    retu") == \
        "def f(x):\n    if x:\n        return 1\n"
    assert not parses(generated_block("def f(x):", "\n    s = '''\n    text\n")) and parses("def f(x):\n    return x\n")


@pytest.fixture(scope="module")
def greedy_completions():
    pretrained = brrr.load(device="cpu")
    params = SamplingParams(max_tokens=64, temperature=0)
    return {p: pretrained.generate(p, params) for p in PROMPTS}


def test_greedy_completions_are_plausible_python(greedy_completions):
    blocks = {p: generated_block(p, c) for p, c in greedy_completions.items()}
    fib = blocks["def fibonacci(n):"]
    assert parses(fib) and fib.count("\n") >= 2, fib  # a body, not just the prompt
    parsed = [p for p, b in blocks.items() if parses(b)]
    report = "\n".join(f"{'ok ' if p in parsed else 'BAD'} {blocks[p]!r}" for p in PROMPTS)
    assert len(parsed) >= len(PROMPTS) / 2, report


def test_transformers_agrees_with_brrr_on_the_default_model():
    transformers = pytest.importorskip("transformers")
    ids = brrr.Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode("import sys\n\n\ndef main(argv):\n    return 0\n")
    with torch.no_grad():
        ours = brrr.forward_logits(brrr.load_model(DEFAULT_MODEL_DIR, dtype="float32"), ids)
        ref = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)(
            torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)("def f():")["input_ids"] == \
        brrr.Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode("def f():")
