"""What lm-eval, guidellm and aiperf send and read, each of which failed or was silently dropped before (issue 55):
scoring-only requests (max_tokens 0 with echo), GET /tokenizer_info, stream_options.continuous_usage_stats,
max_completion_tokens with ignore_eos on completions, the vllm: metric names; and the range checks a new user hit
(logit_bias outside OpenAI's [-100, 100], a max_tokens larger than any context, named as the field it is)."""
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brrr.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, CONTEXT, MODEL_NAME
from tests.server.test_errors import CHAT, COMPLETION, error_of

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def events(response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_scoring_only_request_returns_the_prompt_logprobs(http, offline):
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)[0]
    want_lp = [None] + [entry[t] for t, entry in zip(ids[1:], want.prompt_logprobs[1:])]
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                               "logprobs": 1, "stream": stream,
                                               **({"stream_options": {"include_usage": True}} if stream else {})})
        assert r.status_code == 200, r.text
        if stream:
            chunks = events(r)
            (choice,) = [c for chunk in chunks for c in chunk["choices"]]
            usage = chunks[-1]["usage"]
        else:
            (choice,), usage = r.json()["choices"], r.json()["usage"]
        assert choice["text"] == offline.tokenizer.decode(ids) and choice["finish_reason"] == "length"
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        assert got[1:] == pytest.approx(want_lp[1:], abs=1e-5)
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)


def test_max_tokens_zero_needs_echo(http):
    for body, param in (({**COMPLETION, "max_tokens": 0}, "max_tokens"),
                        ({**COMPLETION, "max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
                        ({**COMPLETION, "max_tokens": 0, "echo": True, "n": 2}, "max_tokens")):
        error = error_of(http.post("/v1/completions", json=body), 400)
        assert error["param"] == param and error["message"].startswith(param), error


def test_tokenizer_info(http, server):
    info = http.get("/tokenizer_info").json()
    tokenizer = server.llm.tokenizer
    assert info["eos_token"] == tokenizer.special_tokens["eos_token"] == "<|eos|>"
    assert info["bos_token"] == "<|bos|>" and info["pad_token"] == "<|pad|>"
    assert info["model_max_length"] == CONTEXT and info["chat_template"] == tokenizer.chat_template
    assert http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"] \
        == [tokenizer.eos_token_id]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_and_fixed_length_outputs(http, path):
    """guidellm's streamed request: usage in every chunk, and ignore_eos with max_completion_tokens for an exact
    output length (on completions too, where brrr read only max_tokens and generated 16)."""
    body = {**(CHAT if "chat" in path else COMPLETION), "max_tokens": None, "max_completion_tokens": 12,
            "ignore_eos": True, "stop": None, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(http.post(path, json=body))
    with_tokens = [c for c in chunks if c["choices"]]
    assert with_tokens and all("usage" in c for c in chunks)
    produced = [c["usage"]["completion_tokens"] for c in with_tokens]
    assert produced == sorted(produced) and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    plain = events(http.post(path, json={**body, "stream_options": {"include_usage": True}}))
    assert ["usage" in c for c in plain] == [False] * (len(plain) - 1) + [True]


def test_logit_bias_outside_openais_range(http):
    for bias in (1000, -100.5):
        error = error_of(http.post("/v1/completions", json={**COMPLETION, "logit_bias": {"5": bias}}), 400)
        assert error["param"] == "logit_bias.5" and "[-100, 100]" in error["message"], error
    assert http.post("/v1/completions", json={**COMPLETION, "logit_bias": {"5": -100}}).status_code == 200


def test_huge_max_tokens_names_max_tokens(http):
    for path, body, param in (("/v1/completions", {**COMPLETION, "max_tokens": 10**12}, "max_tokens"),
                              ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**12},
                               "max_completion_tokens"),
                              ("/v1/chat/completions", {**CHAT, "max_tokens": CONTEXT + 1}, "max_tokens")):
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == param and error["code"] == "context_length_exceeded", error
        assert error["message"].startswith(param) and str(CONTEXT) in error["message"], error
    # a prompt that does not fit beside a cap that would is still the prompt's fault
    long_prompt = {**COMPLETION, "prompt": [1] * (CONTEXT - 2), "max_tokens": 8}
    assert error_of(http.post("/v1/completions", json=long_prompt), 400)["param"] == "prompt"


def test_vllm_metric_names(http):
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_success"):
        ours, theirs = families[f"brrr:{name}"], families[f"vllm:{name}"]
        assert ours.type == theirs.type
        assert [(s.name.replace("brrr:", "vllm:"), s.labels) for s in ours.samples] == \
            [(s.name, s.labels) for s in theirs.samples]
    assert "vllm:request_aborted" not in families  # vLLM has no such family: brrr's name only


def test_runtime_lora_loading_is_off_unless_asked(http):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        error = error_of(http.post(path, json=body), 403)
        assert error["code"] == "runtime_lora_disabled" and "--enable-runtime-lora" in error["message"]
