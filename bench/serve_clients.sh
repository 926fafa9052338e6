#!/usr/bin/env bash
# guidellm and aiperf against a running `brrr serve`, beside `brrr bench serve` on the same load (one request at a
# time, 64 prompt + 32 output tokens, ignore_eos): each finishes with zero errors, and their TTFT/ITL are compared.
# Usage: URL=http://127.0.0.1:8000 MODEL=brrr-default TOKENIZER=brrr/assets/default-model OUT=DIR bash bench/serve_clients.sh
# (run from the repo root; the clients are the [test] extra's; TOKENIZER: a local HF tokenizer directory).
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}; MODEL=${MODEL:-brrr-default}; TOKENIZER=${TOKENIZER:-brrr/assets/default-model}
OUT=${OUT:-/tmp/serve-clients}; N=${N:-16}
mkdir -p "$OUT"
TOKENIZER=$(cd "$TOKENIZER" && pwd)
python -m brrr bench serve --base-url "$URL" --model "$MODEL" --num-prompts "$N" --input-len 64 --output-len 32 \
  --max-concurrency 1 --ignore-eos --seed 0 --save-result "$OUT/brrr.json" > "$OUT/brrr.txt"
guidellm run --backend "kind=openai_http,target=$URL,model=$MODEL" --profile kind=synchronous \
  --constraint "kind=max_requests,count=$N" --tokenizer "kind=hf_auto,model=$TOKENIZER" \
  --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 --output "kind=json,path=$OUT/guidellm.json" \
  --disable-console-interactive > "$OUT/guidellm.txt" 2>&1
# aiperf resolves --tokenizer as a hub id under HF_HUB_OFFLINE=1; a local directory loads without it
env -u HF_HUB_OFFLINE aiperf profile --model "$MODEL" --url "$URL" --endpoint-type completions --streaming \
  --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0 --output-tokens-mean 32 \
  --output-tokens-stddev 0 --request-count "$N" --concurrency 1 --tokenizer "$TOKENIZER" \
  --artifact-dir "$OUT/aiperf" --ui-type none > "$OUT/aiperf.txt" 2>&1
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
brrr = json.loads((out / "brrr.json").read_text())
g = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]
a = json.loads(next((out / "aiperf").rglob("profile_export_aiperf.json")).read_text())
rows = [
    {"client": "brrr bench serve", "completed": brrr["completed"], "errors": brrr.get("failed", 0),
     "ttft_ms_mean": brrr["mean_ttft_ms"], "ttft_ms_median": brrr["median_ttft_ms"],
     "itl_ms_mean": brrr["mean_itl_ms"], "itl_ms_median": brrr["median_itl_ms"]},
    {"client": "guidellm", "completed": g["scheduler_metrics"]["requests_made"]["successful"],
     "errors": g["scheduler_metrics"]["requests_made"]["errored"],
     "ttft_ms_mean": g["metrics"]["time_to_first_token_ms"]["successful"]["mean"],
     "ttft_ms_median": g["metrics"]["time_to_first_token_ms"]["successful"]["median"],
     "itl_ms_mean": g["metrics"]["inter_token_latency_ms"]["successful"]["mean"],
     "itl_ms_median": g["metrics"]["inter_token_latency_ms"]["successful"]["median"]},
    {"client": "aiperf", "completed": a["request_count"]["avg"], "errors": len(a.get("error_summary") or []),
     "ttft_ms_mean": a["time_to_first_token"]["avg"], "ttft_ms_median": a["time_to_first_token"]["p50"],
     "itl_ms_mean": a["inter_token_latency"]["avg"], "itl_ms_median": a["inter_token_latency"]["p50"]},
]
for row in rows:
    row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
    print(json.dumps({"bench": "serve_clients", **row}))
PY
