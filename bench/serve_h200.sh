#!/usr/bin/env bash
# Issue 5's H200 serving benchmark: for each shape, a random-weight bf16 checkpoint (brrr.bench.random_model) with
# the default model's tokenizer, `brrr serve`, `brrr bench serve` at rising request rates (goodput: p99 TTFT <=
# 500 ms, p99 TPOT <= 50 ms), then the offline LLM on the same requests (bench/serve_overhead.py).
#   OUT=dir bash bench/serve_h200.sh [presets...]      (default: llama-3.2-1b llama-3.1-8b)
set -u
OUT=${OUT:-bench/results/serve_h200}
mkdir -p "$OUT"
PORT=8100
ENGINE="--max-num-seqs 256 --max-num-batched-tokens 2048"
presets=${*:-llama-3.2-1b llama-3.1-8b}
for preset in $presets; do
  dir=/tmp/ckpt-$preset
  python - "$preset" "$dir" <<'PY'
import shutil, sys, torch
from brrr.bench.random_model import model_config, random_model
from brrr.default_model import default_model_dir
from brrr.loader import save_model
preset, out = sys.argv[1:]
save_model(random_model(model_config(preset), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu"), out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(default_model_dir() / name, out)
PY
  python -m brrr serve --model "$dir" --port $PORT $ENGINE --no-access-log \
    --log-level warning > "$OUT/$preset-server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  for rate in 4 16 64 inf; do
    python -m brrr bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 200 --input-len 512 \
      --output-len 256 --request-rate $rate --goodput ttft:500 tpot:50 --num-warmups 4 \
      --save-result "$OUT/$preset-rate-$rate.json" > "$OUT/$preset-rate-$rate.txt" 2>&1
    tail -n 30 "$OUT/$preset-rate-$rate.txt" | grep -iE "throughput|P99|goodput" | head -8
  done
  kill -TERM $pid; wait $pid
  python bench/serve_overhead.py --result "$OUT/$preset-rate-inf.json" --model "$dir" $ENGINE | tee -a "$OUT/overhead.jsonl"
done
