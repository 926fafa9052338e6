"""The engine in a process of its own: the records crossing the pipe rebuild the in-process outputs, a consumer that falls
behind gets merged outputs, the warm-up leaves nothing behind, and when the engine process dies, requests in flight
fail with a clear error and /health says so."""
import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from brrr.config import EngineConfig
from brrr.engine import EngineCore, EngineOutput, LLMEngine, OutputProcessor
from brrr.engine.async_llm import _LatestOutput
from brrr.engine.engine_process import engine_stats
from brrr.engine.engine_process_warmup import warm_up
from brrr.sampling_params import SamplingParams
from tests.server.conftest import CONTEXT, LINUX, MODEL_NAME, running, serve, start_engine


def engine(pretrained, **config):
    return LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(num_blocks=512, **config),
                     pretrained.eos_token_ids)


def test_records_across_the_pipe_rebuild_the_in_process_outputs(pretrained):
    """An EngineCore's records, pickled as the pipe does and run through an OutputProcessor, give every field of
    every step's output that LLMEngine gives in-process: n=2 samples with logprobs, prompt logprobs over a chunked
    prompt, and a stop string (held-back text, and the sample dropped in the engine)."""
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=12, n=2, seed=7, logprobs=2, prompt_logprobs=1, stop=["e"])
    local = engine(pretrained, max_num_batched_tokens=8)  # the 20-token prompt takes 3 steps: partial prompt logprobs
    core = EngineCore(pretrained.model, pretrained.tokenizer, EngineConfig(num_blocks=512, max_num_batched_tokens=8),
                      pretrained.eos_token_ids)
    processor = OutputProcessor(pretrained.tokenizer)
    request = local.add_request("r", prompt, params)
    processor.add_request(core.add_request("r", prompt, params))
    steps = 0
    while local.has_unfinished_requests() or core.has_unfinished_requests():
        wants = local.step()
        records = pickle.loads(pickle.dumps(core.step()))
        assert all(isinstance(r, EngineOutput) for r in records)
        processed = processor.process(records)
        for request_id, index in processed.stopped:
            core.abort(request_id, index)
        assert [(o.outputs, o.prompt_logprobs, o.finished) for o in processed.outputs] == \
            [(o.outputs, o.prompt_logprobs, o.finished) for o in wants]
        steps += bool(wants)
    got = processed.outputs[-1] if processed.outputs else wants[-1]
    assert steps >= 4 and len(got.outputs) == 2 and len(got.prompt_logprobs) == len(prompt)
    assert request.arrival_time <= got.metrics.first_scheduled_time
    assert not processor.has_unfinished_requests()


def test_a_consumer_that_falls_behind_gets_one_merged_output(pretrained):
    eng = engine(pretrained)
    params = SamplingParams(max_tokens=6, n=2, seed=1, ignore_eos=True, logprobs=1)
    eng.add_request("r", [5, 6, 7], params)
    slot, outputs = _LatestOutput(), []
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.append(out)
            slot.put(out)
    merged = asyncio.run(slot.get())
    last = outputs[-1]
    assert merged.finished and [c.token_ids for c in merged.outputs] == [c.token_ids for c in last.outputs]
    for c in merged.outputs:  # the deltas of every step, in order
        assert c.delta_token_ids == c.token_ids
        assert c.delta_text == c.text
        assert c.delta_logprobs == c.logprobs and len(c.logprobs) == 6


def test_warm_up_runs_the_full_plan_and_frees_everything(pretrained):
    eng = engine(pretrained, max_num_batched_tokens=2048)
    steps = warm_up(eng, full=True)
    stats = engine_stats(eng)
    assert steps == stats["num_steps"] > 10
    assert stats["num_unfinished_requests"] == stats["num_unfinished_seqs"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["prompt_tokens"] > 2048  # the budget-long prompt was there, cut to the context


def test_stats_come_across_and_start_after_the_warm_up(server):
    stats = server.stats()
    for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "num_blocks", "num_free_blocks",
                "prompt_tokens", "generation_tokens", "num_unfinished_requests"):
        assert key in stats, key
    info = server.llm.info
    assert (info.num_blocks, info.block_size, info.max_model_len) == (512, 16, CONTEXT)
    assert info.pid != os.getpid() and info.warm_up_seconds > 0


def test_when_the_engine_process_dies_requests_fail_and_health_says_so(model_dir, pretrained):
    llm = start_engine(model_dir, pretrained)
    assert llm.stats()["num_steps"] == 0  # the warm-up's steps are not counted
    with serve(llm, model_dir) as server, httpx.Client(base_url=server.base_url, timeout=30) as http:
        long = {"model": MODEL_NAME, "prompt": "x", "max_tokens": CONTEXT - 16, "ignore_eos": True}
        blocking = {}
        waiter = threading.Thread(target=lambda: blocking.update(r=http.post("/v1/completions", json=long)))
        with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines))["choices"]  # generating
            waiter.start()
            deadline = time.monotonic() + 10
            while server.stats()["num_unfinished_requests"] < 2:
                assert time.monotonic() < deadline, "the second request never reached the engine"
                time.sleep(0.01)
            os.kill(llm.info.pid, signal.SIGKILL)
            rest = list(lines)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_error" and "engine process was killed by SIGKILL" in error["message"]
        waiter.join(timeout=10)
        assert blocking["r"].status_code == 500
        assert "killed by SIGKILL" in blocking["r"].json()["error"]["message"]

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "killed by SIGKILL" in health.json()["reason"]
        refused = http.post("/v1/completions", json={**long, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        assert http.get("/v1/models").status_code == 200  # what needs no engine still works


SERVER_STAND_IN = """
import sys
from brrr.config import EngineConfig
from brrr.engine.engine_process import EngineSpec
from brrr.engine.engine_process_client import EngineClient

spec = EngineSpec(sys.argv[1], "float32", "cpu", EngineConfig(num_blocks=64), cpu_threads=1, warm_up=False)
print(EngineClient.spawn(spec).wait_ready().pid, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.skipif(not LINUX, reason="watches the engine process through /proc")
def test_the_engine_process_exits_when_its_server_is_killed(model_dir):
    """No orphans: SIGKILL gives the server no chance to say anything, and the engine process still goes."""
    server = subprocess.Popen([sys.executable, "-c", SERVER_STAND_IN, str(model_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(server.stdout.readline())
        assert running(engine_pid)
        server.kill()
        server.wait(timeout=10)
        deadline = time.monotonic() + 10
        while running(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its server"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_huge_prompt_does_not_stall_the_event_loop():
    """A command larger than the pipe holds (a 100k-token prompt is ~0.5 MB pickled) must not block the event loop
    until the engine, busy with a step, gets round to reading it: other coroutines keep running, and the command
    arrives whole."""
    import multiprocessing

    from brrr.engine.engine_process_client import EngineClient

    commands_in, commands_out = multiprocessing.Pipe(duplex=False)
    outputs_in, outputs_out = multiprocessing.Pipe(duplex=False)
    engine = threading.Thread(target=lambda: None)  # stands in for the engine process: nothing to run here
    engine.start()
    client = EngineClient(commands_out, outputs_in, engine)
    huge = ("add", list(range(100_000, 1_100_000)))  # ~5 MB pickled: more than any pipe buffer
    received = []

    def busy_engine():  # reads its commands only after a while
        time.sleep(1.0)
        received.append(commands_in.recv())

    reader = threading.Thread(target=busy_engine)
    reader.start()

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        start = time.monotonic()
        client.send(huge)
        sent_in, before = time.monotonic() - start, ticks
        await asyncio.sleep(0.5)
        task.cancel()
        return sent_in, ticks - before

    sent_in, ticks = asyncio.run(run())
    reader.join(timeout=30)
    client.shutdown(timeout=5)
    assert sent_in < 0.2, f"send blocked the event loop for {sent_in:.2f} s"
    assert ticks >= 10  # other coroutines ran meanwhile
    assert received == [huge]


def test_warm_up_builds_the_grammar_library_s_vocabulary(pretrained):
    """A guided request is part of the warm-up, so the first user's pays no vocabulary read or first compile."""
    from brrr.engine.guided import compile_cache_info

    before = compile_cache_info()["misses"] + compile_cache_info()["hits"]
    warm_up(engine(pretrained), full=False)
    assert compile_cache_info()["misses"] + compile_cache_info()["hits"] > before
