"""The official `openai` client against a live server: every answer equals the offline LLM's for the same seed."""
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brrr.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, CONTEXT, MODEL_NAME

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def offline_one(offline, prompt, **params):
    return offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_completion_equals_offline(client, offline):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=5)
    want = offline_one(offline, PROMPT, max_tokens=12, temperature=0.8, seed=5)
    (choice,) = r.choices
    assert (choice.text, choice.finish_reason) == (want.outputs[0].text, want.outputs[0].finish_reason)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0 and r.model == MODEL_NAME


def test_chat_equals_offline(client, offline):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0.7, seed=3,
                                       top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0.7, seed=3, top_p=0.9,
                                                 presence_penalty=0.5, frequency_penalty=0.3))
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert (choice.message.content, choice.finish_reason) == (want.outputs[0].text, want.outputs[0].finish_reason)
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode_chat(MESSAGES))
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_streaming_chat_with_usage_equals_offline(client, offline):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=20, seed=11,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=20, seed=11, ignore_eos=True)).outputs[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(offline.tokenizer.encode_chat(MESSAGES))
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_n2_equals_offline(client, offline):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2, seed=21,
                                       extra_body={"ignore_eos": True})
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=8, n=2, seed=21, ignore_eos=True))
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [o.text for o in want.outputs]
    assert r.usage.completion_tokens == 16
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, seed=4, stream=True,
                                       extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    want = offline_one(offline, PROMPT, max_tokens=6, n=2, seed=4, ignore_eos=True)
    assert [texts[0], texts[1]] == [o.text for o in want.outputs]


def test_stop_string_cuts_like_offline(client, offline):
    full = offline_one(offline, PROMPT, max_tokens=30, temperature=0, ignore_eos=True).outputs[0].text
    stop = next(full[i:i + 3] for i in range(8, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: full.index(stop)], "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == full[: full.index(stop)]


def test_completion_logprobs_and_echo(client, offline):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    want = offline_one(offline, PROMPT, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True).outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, entry, got, top in zip(want.token_ids, want.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(entry[token], abs=1e-5)
        # the top 3 plus the chosen token, keyed by text (byte tokens that all read U+FFFD share one key)
        assert set(top) == {offline.tokenizer.decode([t], skip_special_tokens=False) for t in entry}
        assert max(top.values()) == pytest.approx(max(entry.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)

    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    choice = echoed.choices[0]
    n_prompt = echoed.usage.prompt_tokens
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(choice.logprobs.tokens) == n_prompt + 4
    assert choice.logprobs.token_logprobs[0] is None and all(
        x is not None for x in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[n_prompt] == len(PROMPT)


def test_chat_logprobs_equal_offline(client, offline):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)).outputs[0]
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item, token, entry in zip(content, want.token_ids, want.logprobs):
        assert item.logprob == pytest.approx(entry[token], abs=1e-5)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(max(entry.values()), abs=1e-5)  # greedy: the argmax
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_token_id_prompts_in_a_batch(client, offline):
    tok = offline.tokenizer
    prompts = [tok.encode("Hello"), tok.encode("The quick brown fox")]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0)
    want = offline.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in want]
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_models_tokenize_detokenize_health(client, server, offline):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == CONTEXT
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}, headers=headers).json()
    assert tokens["tokens"] == offline.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES}, headers=headers).json()
    assert chat["tokens"] == offline.tokenizer.encode_chat(MESSAGES)
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == offline.tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_metrics_track_requests(client, server):
    def scrape():
        text = httpx.get(server.base_url + "/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.labels.get("model_name") == MODEL_NAME and (s.labels.get("finished_reason") in (None, "length"))}

    before = scrape()
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    server.wait_idle()
    after = scrape()
    assert after["brrr:request_success_total"] == before["brrr:request_success_total"] + 1
    assert after["brrr:generation_tokens_total"] == before["brrr:generation_tokens_total"] + 7
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"brrr:{name}_count"] == before[f"brrr:{name}_count"] + 1
    assert after["brrr:inter_token_latency_seconds_count"] == before["brrr:inter_token_latency_seconds_count"] + 6
    assert after["brrr:prefix_cache_queries_total"] >= before["brrr:prefix_cache_queries_total"] + r.usage.prompt_tokens
    stats = server.stats()
    assert after["brrr:prompt_tokens_total"] == stats["prompt_tokens"]
    assert after["brrr:kv_cache_usage_perc"] == 0.0 and after["brrr:num_requests_running"] == 0.0
