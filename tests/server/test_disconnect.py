"""Cancellation: clients that hang up (streaming or not) have their requests aborted and their KV blocks freed,
while everyone else is served exactly what the offline engine produces."""
import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brrr.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, CONTEXT, MODEL_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def counters(server) -> dict:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.endswith("_total")}


@pytest.fixture(params=["engine_process", "engine_thread"])
def any_server(request):
    """The shared server of each kind: the engine in its own process (what `brrr serve` runs), and in a thread on an
    engine object (which lets the test check the block manager's invariants too)."""
    return request.getfixturevalue("server" if request.param == "engine_process" else "thread_server")


def test_32_streaming_clients_8_disconnect(any_server, offline):
    server = any_server
    prompts = [f"client {i}: def add(a, b):" for i in range(32)]
    quitters = set(range(0, 32, 4))  # 8 of them
    before = counters(server)

    async def client(i, api):
        max_tokens = 1000 if i in quitters else 12
        stream = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompts[i]}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, chunks = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                chunks += 1
            if i in quitters and chunks == 4:
                await stream.close()  # hang up mid-generation
                return None
        return text

    async def run():
        api = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
        async with api:
            return await asyncio.gather(*(client(i, api) for i in range(32)))

    texts = asyncio.run(run())
    server.assert_all_blocks_free()  # every KV block is back

    stayers = [i for i in range(32) if i not in quitters]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [offline.chat([{"role": "user", "content": prompts[i]}], params).outputs[0].text for i in stayers]
    assert [texts[i] for i in stayers] == want
    assert all(texts[i] is None for i in quitters)
    after = counters(server)
    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    assert grew(("brrr:request_success_total", "length")) == 24
    assert grew(("brrr:request_aborted_total", None)) == 8
    generated = after[("brrr:generation_tokens_total", None)] - before[("brrr:generation_tokens_total", None)]
    assert generated < 24 * 12 + 8 * 1000 / 4  # the quitters were stopped early, not run to the end


def test_non_streaming_client_that_times_out_is_aborted(server):
    before = server.stats()["generation_tokens"]
    max_tokens = CONTEXT - 16
    start = time.monotonic()
    try:
        httpx.post(server.base_url + "/v1/completions", headers=HEADERS, timeout=0.5,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True})
        raise AssertionError("the request finished before the client's timeout; make it longer")
    except httpx.ReadTimeout:
        pass
    stats = server.wait_idle(timeout=5)
    generated = stats["generation_tokens"] - before
    assert 0 < generated < max_tokens, f"{generated} tokens: the request ran on after its client left"
    assert time.monotonic() - start < 5
    assert stats["num_free_blocks"] == stats["num_blocks"]
