"""guidellm and aiperf, the load generators people point at vLLM, run offline against `brrr serve` (the shared
clients server, a local tokenizer, synthetic prompts): every request completes, with no errors, and each produced
exactly the fixed output length they ask for (ignore_eos with max_tokens / max_completion_tokens, usage read from
the stream). Their latencies against `brrr bench serve` on the same load: bench/serve_clients.sh and
bench/results/serve_clients_cpu.jsonl (a shared 2-core CPU says little about latency)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import CLIENTS_MODEL

BIN = Path(sys.executable).parent
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 48, 16


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is a [test] dependency; not installed here")
    return path


def test_guidellm(clients_server, plain_model_dir, tmp_path):
    out = tmp_path / "guidellm.json"
    subprocess.run([tool("guidellm"), "run", "--backend",
                    f"kind=openai_http,target={clients_server.base_url},model={CLIENTS_MODEL}",
                    "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
                    "--tokenizer", f"kind=hf_auto,model={plain_model_dir}", "--data",
                    f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                    "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (bench,) = json.loads(out.read_text())["benchmarks"]
    assert bench["scheduler_metrics"]["requests_made"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                           "total": REQUESTS}
    lengths = bench["metrics"]["output_token_count"]["successful"]
    assert lengths["min"] == lengths["max"] == OUTPUT_TOKENS
    assert bench["metrics"]["time_to_first_token_ms"]["successful"]["count"] == REQUESTS


def test_aiperf(clients_server, plain_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # it reads a local directory only then
    subprocess.run([tool("aiperf"), "profile", "--model", CLIENTS_MODEL, "--url", clients_server.base_url,
                    "--endpoint-type", "completions", "--streaming", "--synthetic-input-tokens-mean",
                    str(PROMPT_TOKENS), "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean",
                    str(OUTPUT_TOKENS), "--output-tokens-stddev", "0", "--request-count", str(REQUESTS),
                    "--concurrency", "2", "--tokenizer", str(plain_model_dir), "--artifact-dir", str(tmp_path),
                    "--extra-inputs", '{"ignore_eos": true}',  # fixed lengths: the random model may draw EOS
                    "--ui-type", "none"], check=True, capture_output=True, timeout=300, env=env)
    (export,) = tmp_path.rglob("profile_export_aiperf.json")
    result = json.loads(export.read_text())
    assert result["request_count"]["avg"] == REQUESTS and not result.get("error_summary")
    # the server's usage (aiperf's own output_sequence_length re-tokenizes the noise model's text, which differs)
    usage = result["usage_completion_tokens"]
    assert usage["min"] == usage["max"] == OUTPUT_TOKENS
    assert result["time_to_first_token"]["count"] == REQUESTS
