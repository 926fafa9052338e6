"""Every bad input gets its status and OpenAI's error shape, and the server keeps serving afterwards."""
import json
import threading
import time

import httpx
import openai
import pytest

from brrr.config import EngineConfig
from tests.server.conftest import API_KEY, CONTEXT, MODEL_NAME, serve, start_engine

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=30) as client:
        yield client


def test_api_key(server):
    assert error_of(httpx.post(server.base_url + "/v1/chat/completions", json=CHAT), 401)["code"] == "invalid_api_key"
    wrong = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer nope"})
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(server.base_url + "/v1/models"), 401)["type"] == "invalid_request_error"
    assert httpx.get(server.base_url + "/health").status_code == 200  # open: probes and scrapers carry no key
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_malformed_json_and_wrong_types(http):
    bad = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', 
                    headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(bad, 400)["message"]
    assert "JSON object" in error_of(http.post("/v1/completions", json=[1, 2]), 400)["message"]
    for path, body, param in (
            ("/v1/completions", {**COMPLETION, "max_tokens": "ten"}, "max_tokens"),
            ("/v1/completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
            ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
            ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
            ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
            ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
            ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
            ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ):
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error" and param in error["message"]


def test_out_of_range_and_unsupported_fields(http):
    for body, param in (({**CHAT, "top_p": 0}, "top_p"), ({**CHAT, "temperature": 500}, "temperature"),
                        ({**CHAT, "n": 0}, "n"), ({**CHAT, "max_tokens": 0}, "max_tokens"),
                        ({**CHAT, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
                        ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
                        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
                        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
                        ({**COMPLETION, "suffix": "x"}, "suffix"),
                        ({**COMPLETION, "prompt": [[]]}, "prompt"), ({**COMPLETION, "prompt": [999999]}, "prompt")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == param, (body, error)
    image = {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert error_of(http.post("/v1/chat/completions", json=image), 400)["param"] == "messages.0.content.0.type"


def test_error_param_names_the_field_the_request_used(http):
    """Chat's top_logprobs and max_completion_tokens become SamplingParams' logprobs and max_tokens: an error names
    what the caller sent, in the message too."""
    for body, param in (({**CHAT, "logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
                        ({**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
                        ({**CHAT, "max_tokens": -5}, "max_tokens"),
                        ({**COMPLETION, "logprobs": 1000}, "logprobs")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == param and error["message"].startswith(param + " "), (body, error)


def test_unknown_role_is_refused(http):
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages.1.role" and "'wizard'" in error["message"] and "'assistant'" in error["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(http, value):
    """Python's JSON reader takes NaN and Infinity, and NaN compares False with every limit."""
    for path, base, field in (("/v1/chat/completions", CHAT, "temperature"), ("/v1/chat/completions", CHAT, "top_p"),
                              ("/v1/completions", COMPLETION, "presence_penalty"),
                              ("/v1/completions", COMPLETION, "frequency_penalty"),
                              ("/v1/completions", COMPLETION, "repetition_penalty"),
                              ("/v1/completions", COMPLETION, "min_p")):
        body = json.dumps(base)[:-1] + f', "{field}": {value}}}'
        error = error_of(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
        assert error["param"] == field, (field, value, error)


def test_lone_surrogates_are_a_400_and_the_connection_stays_open(http):
    """"\\ud800" is valid JSON but not a character: no tokenizer encodes it. Each is a 400 naming where it was, on
    the same keep-alive connection."""
    connections = []
    hooks = {"response": [lambda r: connections.append(id(r.extensions.get("network_stream")))]}
    with httpx.Client(base_url=str(http.base_url), headers=HEADERS, timeout=30, event_hooks=hooks) as client:
        for path, body, param in (
                ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
                ("/v1/completions", {**COMPLETION, "prompt": ["ok", "a\udc00"]}, "prompt.1"),
                ("/v1/completions", {**COMPLETION, "stop": "\ud800"}, "stop"),
                ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]},
                 "messages.0.content"),
                ("/v1/chat/completions",
                 {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
                 "messages.0.content.0.text"),
                ("/tokenize", {"prompt": "a\ud800"}, "prompt")):
            sent = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            error = error_of(sent, 400)  # json.dumps escapes the surrogate as the client would send it
            assert error["param"] == param and "surrogate" in error["message"], (body, error)
        assert client.post("/v1/completions", json={**COMPLETION, "prompt": "a\U0001f600b"}).status_code == 200
    assert len(set(connections)) == 1  # no error closed the connection


def test_context_overflow_names_the_numbers(http, server):
    error = error_of(http.post("/v1/completions", json={**COMPLETION, "max_tokens": CONTEXT}), 400)
    n_prompt = len(server.llm.tokenizer.encode("hi"))
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"prompt ({n_prompt} tokens) + max_tokens ({CONTEXT}) = {n_prompt + CONTEXT}" in error["message"]
    assert f"context of {CONTEXT} tokens" in error["message"]
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * CONTEXT}]}
    assert error_of(http.post("/v1/chat/completions", json=long_chat), 400)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=CONTEXT)


def test_unknown_model_route_and_method(http):
    error = error_of(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "gpt-9" in error["message"]
    error_of(http.post("/v1/nothing-here", json={}), 404)
    error_of(http.get("/v1/chat/completions"), 405)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "some_future_field": {"x": 1}, "user": "me"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_body_too_large(http):
    big = {**COMPLETION, "prompt": "x" * (80 << 10)}  # over the test server's 64 KiB
    error = error_of(http.post("/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large" and str(64 << 10) in error["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'", "max_tokens": 2}'

    error_of(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)


def test_tokenize_detokenize_errors(http):
    assert error_of(http.post("/detokenize", json={"tokens": [10 ** 6]}), 400)["param"] == "tokens"
    error_of(http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)
    error_of(http.post("/tokenize", json={"prompt": 3}), 400)
    assert error_of(http.post("/tokenize", json={"messages": []}), 400)["param"] == "messages"  # found by schemathesis


def test_still_serving_after_bad_input(http):
    r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_queue_full_gets_429_with_retry_after(model_dir, pretrained):
    """One sequence at a time, one waiting request at most: a third concurrent request is turned away."""
    llm = start_engine(model_dir, pretrained, EngineConfig(num_blocks=512, max_num_seqs=1), in_thread=True)
    with serve(llm, model_dir, max_waiting=1) as server, \
            httpx.Client(base_url=server.base_url, timeout=30) as http:
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs and holds the one slot
            queued = {}
            waiter = threading.Thread(target=lambda: queued.update(r=http.post("/v1/completions", json=COMPLETION)))
            waiter.start()
            deadline = time.monotonic() + 10
            while server.stats()["num_requests_waiting"] != 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.01)
            rejected = http.post("/v1/chat/completions", json=CHAT)
            assert error_of(rejected, 429)["code"] == "queue_full"
            assert rejected.headers["retry-after"] == "1"
            assert "limit is 1" in rejected.json()["error"]["message"]
        # leaving the stream aborted the long request: the queued one runs, and new ones are admitted again
        waiter.join(timeout=30)
        assert queued["r"].status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        server.assert_all_blocks_free()


def test_a_failed_engine_step_is_a_500_and_the_server_goes_on(model_dir, pretrained):
    """Fault injection: the model runner raises once. The engine fails that step's requests (freeing their
    blocks); the server answers them in OpenAI's shape, mid-stream as an SSE error event, and keeps serving."""
    llm = start_engine(model_dir, pretrained, in_thread=True)  # in this process: the test reaches into the runner
    with serve(llm, model_dir) as server, httpx.Client(base_url=server.base_url, timeout=30) as http:
        runner = server.engine.runner
        real_execute, failures = runner.execute, []

        def execute_failing_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                raise RuntimeError("injected kernel failure")
            return real_execute(*args, **kwargs)

        runner.execute = execute_failing_once
        error = error_of(http.post("/v1/completions", json=COMPLETION), 500)
        assert error["code"] == "engine_error" and "injected kernel failure" in error["message"]
        assert error["type"] == "server_error"

        failures.clear()
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected kernel failure" in events[-2]
        assert set(json.loads(events[-2])) == {"error"}

        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        server.assert_all_blocks_free()
