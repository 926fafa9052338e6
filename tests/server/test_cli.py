"""`brrr serve` as a real process: `brrr bench serve` against it, then SIGTERM drains in-flight requests, cancels
what outlives the shutdown timeout, and exits, its engine process with it."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from brrr.cli import main
from tests.server.conftest import CONTEXT, LINUX, engine_processes, running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *flags: str, shutdown_timeout: int | None = None, start_timeout: float = 90):
    """`brrr serve` of model_dir on the CPU (fp32, no API key, quiet) as a child process, with `flags` added; returns
    (process, base url) once /health answers. The server leads a process group of its own, so `stop_server` ends
    it with everything it started (its engine process, tensor-parallel workers); a start that fails or times out
    does that before raising."""
    port = free_port()
    cmd = [sys.executable, "-m", "brrr", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--no-access-log", "--log-level", "warning", *flags]
    if shutdown_timeout is not None:
        cmd += ["--shutdown-timeout", str(shutdown_timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "BRRR_API_KEY": ""}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    try:
        while True:
            assert proc.poll() is None, f"brrr serve exited early:\n{proc.stdout.read()}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "brrr serve did not come up"
            time.sleep(0.1)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc) -> None:
    """Kill whatever is left of a `start_server` process group (the server, its engine process, their workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has exited
        pass
    proc.wait()


@pytest.fixture(scope="module")
def served(model_dir):
    proc, url = start_server(model_dir, "--served-model-name", "tiny-cli", shutdown_timeout=1)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_bench_serve_prints_the_summary_and_saves_json(served, tmp_path, capsys):
    _, url = served
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", url, "--num-prompts", "12", "--input-len", "16", "--output-len", "8",
                 "--request-rate", "40", "--max-concurrency", "6", "--goodput", "ttft:60000", "tpot:60000",
                 "--save-result", str(out)])
    assert code == 0
    summary = capsys.readouterr().out
    for line in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                 "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                 "Total token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                 "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):",
                 "P99 ITL (ms):"):
        assert line in summary, line
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["model"]) == (12, 0, "tiny-cli")
    assert result["total_input_tokens"] == 12 * 16 and result["total_output_tokens"] == 12 * 8
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs loose enough for all
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["max_concurrent_requests"] <= 6
    # a chunk per engine step, each with one token; when the HTTP side falls behind the engine, it merges the
    # steps it missed into one chunk, so there are at most 7 gaps
    print("gaps per request:", [len(itl) for itl in result["requests"]["itls"]])
    assert all(len(itl) <= 8 - 1 for itl in result["requests"]["itls"])
    assert re.search(r"^Successful requests:\s+12$", summary, re.M)
    assert re.search(r"^Failed requests:\s+0$", summary, re.M)
    assert re.search(rf"^Total generated tokens:\s+{12 * 8}$", summary, re.M)

    code = main(["bench", "serve", "--base-url", url, "--endpoint", "chat", "--dataset", "prefix", "--num-prompts",
                 "6", "--prefix-len", "32", "--num-prefixes", "2", "--input-len", "8", "--output-len", "4",
                 "--num-warmups", "0"])
    assert code == 0 and "Successful requests:" in capsys.readouterr().out


def test_bench_serve_rejects_requests_over_the_context(served, capsys):
    _, url = served
    code = main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--input-len", str(CONTEXT),
                 "--output-len", "8"])
    assert code == 2
    assert f"needs {CONTEXT + 8} tokens (input + output); the server's context is {CONTEXT}" in capsys.readouterr().err


def test_sigterm_drains_cancels_what_outlives_the_timeout_and_exits(served):
    """One SIGTERM, two streams: the short one finishes during the drain, the long one outlives --shutdown-timeout
    (1 s) and is cut with an error event and [DONE] (no traceback in the log). New connections are refused meanwhile;
    the server and its engine process exit."""
    proc, url = served
    engines = engine_processes(proc.pid) if LINUX else []
    assert len(engines) == 1 or not LINUX
    short = {"model": "tiny-cli", "prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}
    # 8 samples of the whole context: about 8 s on a 2-core CI machine, so far past the timeout on faster ones too
    long = {**short, "max_tokens": CONTEXT - 16, "n": 8}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=long) as long_r, \
            http.stream("POST", url + "/v1/completions", json=short) as short_r:
        long_lines = long_r.iter_lines()
        assert next(line for line in long_lines if line.startswith("data: "))
        events = (line[6:] for line in short_r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None  # still generating
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(url + "/health", timeout=2)
        rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # it ran to the end, not cut off
        rest = [line[6:] for line in long_lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"  # the long stream is cut, and ends as a stream ends, saying why
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "unavailable" and "shut down" in error["message"], error
    assert proc.wait(timeout=30) == 0
    log = proc.stdout.read()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log
    assert time.monotonic() - start < 10  # the timeout (1 s) cut it, not the request's own end
    assert not [pid for pid in engines if running(pid)]  # the engine process stopped with it


def test_a_busy_port_fails_before_the_model_loads(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "brrr", "serve", "--model", str(model_dir), "--port",
                                 str(port), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"brrr: error: cannot listen on 127.0.0.1:{port}: already in use; pick another --port (or --host)"]


def test_serve_exits_without_nanobind_leak_reports(model_dir):
    """gc.freeze() keeps start-up's objects from every collection, the one at exit too: Triton's nanobind
    bindings then print a 'leaked' line for each of theirs."""
    proc, _ = start_server(model_dir, "--served-model-name", "tiny-cli", shutdown_timeout=1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    output = proc.stdout.read()
    assert "leaked" not in output, output


@pytest.mark.skipif(not LINUX, reason="finds the engine process through /proc")
def test_sigterm_after_the_engine_died_exits_1(model_dir):
    """Before: the server still exited 0 on SIGTERM after its engine process had died, so a supervisor saw a clean
    stop."""
    proc, url = start_server(model_dir)
    try:
        (engine,) = engine_processes(proc.pid)
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health never saw the engine die"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
        assert "the engine failed while serving" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
