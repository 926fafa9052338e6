#!/usr/bin/env bash
# Issue 5's H200 serving benchmark: for each shape, a random-weight bf16 checkpoint (brrr.bench.random_model) with
# the default model's tokenizer, `brrr serve` (its engine in a process of its own, warmed up before /health answers),
# `brrr bench serve` at rising request rates (goodput: p99 TTFT <= 500 ms, p99 TPOT <= 50 ms), then the offline LLM
# on the same requests as the saturation run (bench/serve_overhead.py: HTTP/offline output tok/s, target >= 0.9).
#   OUT=dir bash bench/serve_h200.sh [presets...]      (default: llama-3.2-1b llama-3.1-8b)
# The workload is issue 5's; the variables below only exist to smoke-test the script off the GPU, e.g.
#   OUT=/tmp/x NUM_PROMPTS=8 INPUT_LEN=32 OUTPUT_LEN=8 RATES=inf bash bench/serve_h200.sh smollm2-135m
# SERVE_ARGS adds `brrr serve` options (e.g. --engine-in-thread, the old one-process layout, for an A/B run).
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the repository root: bench/*.py import this brrr
OUT=${OUT:-bench/results/serve_h200}
NUM_PROMPTS=${NUM_PROMPTS:-200}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
RATES=${RATES:-4 16 64 inf}
SERVE_ARGS=${SERVE_ARGS:-}
mkdir -p "$OUT"
PORT=8100
ENGINE="--max-num-seqs 256 --max-num-batched-tokens 2048"
presets=${*:-llama-3.2-1b llama-3.1-8b}
pid=
trap '[ -n "$pid" ] && kill -TERM $pid 2>/dev/null' EXIT
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
  python -m brrr serve --model "$dir" --port $PORT $ENGINE $SERVE_ARGS --no-access-log \
    --log-level warning > "$OUT/$preset-server.log" 2>&1 &
  pid=$!
  # loading, CUDA-graph capture and the warm-up (Triton compiles and autotunes) all happen before /health answers
  for _ in $(seq 900); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  grep "brrr serve:" "$OUT/$preset-server.log"
  seed=0
  for rate in $RATES; do
    seed=$((seed + 1))  # fresh prompts per rate: a later run must not find the earlier runs' prompts in the prefix cache
    python -m brrr bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts $NUM_PROMPTS --input-len $INPUT_LEN \
      --output-len $OUTPUT_LEN --request-rate $rate --goodput ttft:500 tpot:50 --num-warmups 4 --seed $seed \
      --save-result "$OUT/$preset-rate-$rate.json" > "$OUT/$preset-rate-$rate.txt" 2>&1
    tail -n 30 "$OUT/$preset-rate-$rate.txt" | grep -iE "throughput|P99|goodput" | head -8
  done
  kill -TERM $pid; wait $pid; pid=
  python bench/serve_overhead.py --result "$OUT/$preset-rate-inf.json" --model "$dir" $ENGINE | tee -a "$OUT/overhead.jsonl"
done
