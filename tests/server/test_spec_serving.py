"""`brrr serve --speculative-config`: an engine process speculating (n-gram) answers exactly as one that does not,
streamed or not, stop strings included, and /metrics carries vLLM's spec_decode counters."""
import json

import httpx
import pytest

from brrr.config import EngineConfig
from tests.server.conftest import API_KEY, MODEL_NAME, serve, start_engine

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = ["def add(a, b):\n    return a + b\n" * 3, "Hello, world! Hello, world! Hello, world!", "the quick brown fox " * 4]


@pytest.fixture(scope="module")
def spec_server(model_dir, pretrained):
    llm = start_engine(model_dir, pretrained, EngineConfig(num_blocks=512, speculative_config=NGRAM))
    with serve(llm, model_dir, api_key=API_KEY) as running:
        yield running


def complete(base_url, prompt, **extra):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, headers=HEADERS, timeout=60).json()


def streamed_text(base_url, prompt, **extra):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True, **extra}
    text = ""
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_speculative_server_answers_as_the_plain_one(server, spec_server):
    for prompt in PROMPTS:
        want = complete(server.base_url, prompt)["choices"][0]
        got = complete(spec_server.base_url, prompt)["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
        assert streamed_text(spec_server.base_url, prompt) == want["text"]
        if len(want["text"]) > 6:  # a stop string the answer reaches part-way
            stop = want["text"][len(want["text"]) // 2:len(want["text"]) // 2 + 3]
            plain = complete(server.base_url, prompt, stop=[stop])["choices"][0]
            assert complete(spec_server.base_url, prompt, stop=[stop])["choices"][0]["text"] == plain["text"]
            assert streamed_text(spec_server.base_url, prompt, stop=[stop]) == plain["text"]
    spec_server.assert_all_blocks_free()
    metrics = httpx.get(spec_server.base_url + "/metrics").text
    counters = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("brrr:spec_decode")}
    assert counters['brrr:spec_decode_num_accepted_tokens_total{model_name="tiny"}'] > 0  # multi-token outputs
    assert 'brrr:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"}' in metrics
