"""A disaggregated engine behind the server (its decode instance in the engine process, two prefill instances in
processes of their own): the OpenAI API answers as co-located (streaming, stop strings), /metrics counts the KV
transfers, a killed prefill instance leaves the server healthy and serving, and a killed decode instance takes it
down (503) with its prefill instances gone too."""
import json
import os
import signal
import time

import httpx

from brrr.config import EngineConfig
from brrr.sampling_params import SamplingParams
from tests.server.conftest import LINUX, MODEL_NAME, engine_processes, running, serve, start_engine


def _stream(http, body) -> tuple[str, str]:
    text, reason = "", None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                reason = chunk["choices"][0]["finish_reason"] or reason
    return text, reason


def _exited(pid: int) -> bool:
    """Every thread of it gone: its parent's waitpid sees it now (a killed leader shows "Z" while its other threads
    are still exiting)."""
    try:
        return not running(pid) and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def _wait(condition, seconds=15):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_disaggregated_server_answers_as_colocated_and_survives_a_prefill_instance(model_dir, pretrained, offline):
    prompt = list(range(5, 25))
    want = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = want[6:9]  # a stop string the greedy text reaches mid-way
    want_stopped = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                             stop=[stop]), use_tqdm=False)[0].outputs[0]
    llm = start_engine(model_dir, pretrained, EngineConfig(num_blocks=512, disaggregate="prefill=0,2,decode=1"))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with serve(llm, model_dir) as server, httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert _stream(http, body) == (want, "length")
        assert _stream(http, {**body, "stop": [stop]}) == (want_stopped.text, "stop")
        metrics = http.get("/metrics").text
        transfers = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("brrr:kv_transfers_total"))
        assert transfers == 2 and "brrr:prefill_instances_alive" in metrics

        engine_pid = llm.info.pid
        prefill = engine_processes(engine_pid) if LINUX else []
        if not LINUX:
            return
        assert len(prefill) == 2
        os.kill(prefill[0], signal.SIGKILL)
        _wait(lambda: _exited(prefill[0]))
        for _ in range(3):  # routed to the other instance
            assert _stream(http, body) == (want, "length")
        assert http.get("/health").status_code == 200
        assert server.stats()["prefill_instances_alive"] == 1

        os.kill(engine_pid, signal.SIGKILL)  # the decode instance
        _wait(lambda: http.get("/health").status_code == 503)
        _wait(lambda: not running(prefill[1]))  # its pipe closed: the last prefill instance left too


def test_brrr_serve_disaggregate_stops_cleanly_on_sigterm(model_dir):
    from tests.server.test_cli import start_server

    proc, url = start_server(model_dir, "--disaggregate", "prefill=0,decode=1")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert len(httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]) > 0
        engine = engine_processes(proc.pid) if LINUX else []
        prefill = [p for e in engine for p in engine_processes(e)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        if LINUX:
            assert len(prefill) == 1
            _wait(lambda: not running(prefill[0]))  # no orphaned prefill instance
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
