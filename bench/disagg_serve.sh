#!/usr/bin/env bash
# Issue 44's comparison on one host with two GPUs: disaggregated prefill/decode against co-located serving on the
# same two GPUs, at total request rates around what saturates one GPU; goodput under a TTFT and a TPOT SLO
# (DistServe's metric), TTFT and TPOT percentiles. Random bf16 weights of the preset's shape (brrr.models.random_weights)
# with the default model's tokenizer; fresh prompts per rate (no prefix-cache hits across runs).
#   bash bench/disagg_serve.sh checkpoint          # once: writes /tmp/ckpt-$PRESET
#   OUT=dir bash bench/disagg_serve.sh disagg      # brrr serve --disaggregate prefill=0,decode=1, total rate R
#   OUT=dir bash bench/disagg_serve.sh replicas    # two co-located servers, one per GPU, each half the requests at
#                                                  # R/2 with burstiness 2 (every other arrival of a Poisson stream
#                                                  # at R: what a round-robin router in front of them would send)
#   OUT=dir bash bench/disagg_serve.sh tp2         # one co-located server, --tensor-parallel-size 2, total rate R
# Each mode appends one line per rate to $OUT/summary.jsonl (the replicas' two clients merged into one line), and
# keeps each client's full result and each server's log. Smoke test off the GPU (CPU instances, a small shape):
#   OUT=/tmp/x PRESET=smollm2-135m NUM_PROMPTS=6 INPUT_LEN=32 OUTPUT_LEN=8 RATES=4 bash bench/disagg_serve.sh ...
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the repository root: this brrr
MODE=${1:?usage: bash bench/disagg_serve.sh checkpoint|disagg|replicas|tp2}
PRESET=${PRESET:-llama-3.1-8b}
CKPT=/tmp/ckpt-$PRESET
OUT=${OUT:-bench/results/disagg_h100x2}
NUM_PROMPTS=${NUM_PROMPTS:-160}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
# requests per second over both GPUs: from light load to past what one GPU sustains at this length (one H100,
# co-located, near 15 req/s by the H200 runs in docs/serving.md scaled to its bandwidth and twice the prompt)
RATES=${RATES:-8 16 24 32}
SLO=${SLO:-ttft:250 tpot:25}
ENGINE="--max-num-seqs 256 --max-num-batched-tokens 2048 --no-access-log --log-level warning"
mkdir -p "$OUT"

if [ "$MODE" = checkpoint ]; then
  python - "$PRESET" "$CKPT" <<'PY'
import json, shutil, sys, torch
from pathlib import Path
from brrr.models.random_weights import model_config, random_model
from brrr.default_model import default_model_dir
from brrr.loader import save_model
preset, out = sys.argv[1:]
save_model(random_model(model_config(preset), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu"), out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(default_model_dir() / name, out)
# the special ids of the tokenizer it ships with, not the preset's (Llama 3's EOS 128001 is not in this vocabulary)
config, ours = Path(out) / "config.json", json.loads((default_model_dir() / "config.json").read_text())
config.write_text(json.dumps({**json.loads(config.read_text()), "bos_token_id": ours["bos_token_id"],
                              "eos_token_id": ours["eos_token_id"]}, indent=2))
PY
  exit $?
fi
[ -f "$CKPT/config.json" ] || { echo "no checkpoint in $CKPT: run 'bash bench/disagg_serve.sh checkpoint' first"; exit 1; }

pids=()
trap 'for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null; done; wait' EXIT
start_server() {  # PORT LOG [env and serve arguments...]: in the background (two replicas load side by side)
  local port=$1 log=$2; shift 2
  env "$@" --port "$port" > "$log" 2>&1 &
  pids+=($!)
}
wait_server() {  # PORT LOG PID
  for _ in $(seq 600); do  # loading, graph capture and the warm-up come before /health answers
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && { grep "brrr serve:" "$2"; return 0; }
    kill -0 "$3" 2>/dev/null || { echo "brrr serve exited:"; tail -n 20 "$2"; exit 1; }
    sleep 1
  done
  echo "brrr serve did not come up in 600 s"; exit 1
}
client() {  # PORT RATE BURSTINESS SEED RESULT [PROMPTS]
  python -m brrr bench serve --base-url "http://127.0.0.1:$1" --num-prompts "${6:-$NUM_PROMPTS}" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --request-rate "$2" --burstiness "$3" --goodput $SLO --num-warmups 2 --seed "$4" \
    --label "$MODE" --save-result "$5" > "${5%.json}.txt" 2>&1
}
summarize() {  # RATE RESULT... : one line, the clients' requests merged
  python - "$MODE" "$1" "${@:2}" <<'PY' | tee -a "$OUT/summary.jsonl"
import json, sys
mode, rate, files = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
runs = [json.load(open(f)) for f in files]
slo = runs[0]["goodput_slos_ms"]
ttft, tpot, good, done, out_tokens = [], [], 0, 0, 0
for r in runs:
    q = r["requests"]
    for t, lat, n, err in zip(q["ttfts"], q["latencies"], q["output_lens"], q["errors"]):
        if err or not lat:
            continue
        p = (lat - t) / (n - 1) if n > 1 else 0.0
        done, out_tokens = done + 1, out_tokens + n
        ttft.append(t * 1e3)
        tpot.append(p * 1e3)
        good += t * 1e3 <= slo.get("ttft", float("inf")) and p * 1e3 <= slo.get("tpot", float("inf"))
def pct(v, q):
    v = sorted(v)
    return round(v[min(len(v) - 1, int(q / 100 * len(v)))], 1) if v else None
duration = max(r["duration"] for r in runs)
print(json.dumps({"mode": mode, "rate": rate, "slo_ms": slo, "completed": done,
                  "failed": sum(r["failed"] for r in runs), "goodput_req_s": round(good / duration, 2),
                  "slo_attainment": round(good / max(1, done), 3), "output_tok_s": round(out_tokens / duration),
                  "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99), "p50_tpot_ms": pct(tpot, 50),
                  "p99_tpot_ms": pct(tpot, 99)}))
PY
}

SERVE=(python -m brrr serve --model "$CKPT" $ENGINE)
case $MODE in
  disagg)  # --log-level info: the decode instance logs each request's KV transfer (size, time)
    start_server 8100 "$OUT/disagg-server.log" "${SERVE[@]}" --disaggregate prefill=0,decode=1 --log-level info
    wait_server 8100 "$OUT/disagg-server.log" "${pids[0]}" ;;
  tp2)
    start_server 8100 "$OUT/tp2-server.log" "${SERVE[@]}" --tensor-parallel-size 2
    wait_server 8100 "$OUT/tp2-server.log" "${pids[0]}" ;;
  replicas)
    start_server 8100 "$OUT/replica0-server.log" CUDA_VISIBLE_DEVICES=0 "${SERVE[@]}"
    start_server 8101 "$OUT/replica1-server.log" CUDA_VISIBLE_DEVICES=1 "${SERVE[@]}"
    wait_server 8100 "$OUT/replica0-server.log" "${pids[0]}"
    wait_server 8101 "$OUT/replica1-server.log" "${pids[1]}" ;;
  *) echo "unknown mode $MODE: checkpoint, disagg, replicas or tp2"; exit 1 ;;
esac
seed=0
for rate in $RATES; do
  seed=$((seed + 1))
  result="$OUT/$MODE-rate-$rate"
  if [ "$MODE" = replicas ]; then
    half=$(python -c "print($rate / 2)")
    client 8100 "$half" 2 "$seed" "$result-gpu0.json" $((NUM_PROMPTS / 2)) & c0=$!
    client 8101 "$half" 2 "$((seed + 1000))" "$result-gpu1.json" $((NUM_PROMPTS / 2)) & c1=$!
    wait $c0 $c1
    summarize "$rate" "$result-gpu0.json" "$result-gpu1.json"
  else
    client 8100 "$rate" 1 "$seed" "$result.json"
    summarize "$rate" "$result.json"
  fi
done
