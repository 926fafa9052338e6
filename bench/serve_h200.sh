#!/usr/bin/env bash
# Issue 5's H200 serving benchmark: for each shape, a random-weight bf16 checkpoint (brrr.models.random_weights) with
# the default model's tokenizer, `brrr serve` (its engine in a process of its own, warmed up before /health answers),
# `brrr bench serve` at rising request rates (goodput: p99 TTFT <= 500 ms, p99 TPOT <= 50 ms), then the offline LLM
# on the same requests as the saturation run (brrr bench serve-overhead: HTTP/offline output tok/s, target >= 0.9).
#   OUT=dir bash bench/serve_h200.sh [presets...]      (default: llama-3.2-1b llama-3.1-8b)
# The workload is issue 5's; the variables below only exist to smoke-test the script off the GPU, e.g.
#   OUT=/tmp/x NUM_PROMPTS=8 INPUT_LEN=32 OUTPUT_LEN=8 RATES=inf bash bench/serve_h200.sh smollm2-135m
# SERVE_ARGS adds `brrr serve` options (e.g. --engine-in-thread, the old one-process layout, for an A/B run).
# Each rate also writes $preset-rate-$rate-cpu.json: CPU seconds per process of the server tree over the run (which
# process is the bottleneck); PYSPY=1 records py-spy stacks of each of them during the rate-inf run; TRACE=1 writes
# the engine's step timeline, served (the last rate's run) and offline.
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
cpu_snapshot() {  # {pid: [cpu seconds, command]} for the server and its descendants
  python - "$pid" <<'PY'
import json, os, sys
hz, todo, out = os.sysconf("SC_CLK_TCK"), [int(sys.argv[1])], {}
while todo:
    p = todo.pop()
    try:
        todo += [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120]
        out[p] = [(int(fields[11]) + int(fields[12])) / hz, cmd]
    except OSError:
        pass
print(json.dumps(out))
PY
}
trap '[ -n "$pid" ] && kill -TERM $pid 2>/dev/null' EXIT
for preset in $presets; do
  dir=/tmp/ckpt-$preset
  python - "$preset" "$dir" <<'PY'
import shutil, sys, torch
from brrr.models.random_weights import model_config, random_model
from brrr.default_model import default_model_dir
from brrr.loader import save_model
preset, out = sys.argv[1:]
save_model(random_model(model_config(preset), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu"), out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(default_model_dir() / name, out)
PY
  BRRR_ENGINE_TRACE=${TRACE:+$OUT/$preset-engine-trace.jsonl} python -m brrr serve --model "$dir" --port $PORT $ENGINE $SERVE_ARGS --no-access-log \
    --log-level warning > "$OUT/$preset-server.log" 2>&1 &
  pid=$!
  # loading, CUDA-graph capture and the warm-up (Triton compiles and autotunes) all happen before /health answers
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "brrr serve exited:"; tail -n 20 "$OUT/$preset-server.log"; exit 1; }
    sleep 1
  done
  grep "brrr serve:" "$OUT/$preset-server.log"
  seed=0
  for rate in $RATES; do
    seed=$((seed + 1))  # fresh prompts per rate: a later run must not find the earlier runs' prompts in the prefix cache
    before=$(cpu_snapshot); t0=$(date +%s.%N)
    if [ "${PYSPY:-0}" = 1 ] && [ "$rate" = inf ]; then
      for p in $(echo "$before" | python -c 'import json,sys; print(*json.load(sys.stdin))'); do
        py-spy record -p "$p" -d 25 -r 250 -f raw --idle --nonblocking -o "$OUT/$preset-pyspy-$p.txt" > /dev/null 2>&1 &
      done
    fi
    python -m brrr bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts $NUM_PROMPTS --input-len $INPUT_LEN \
      --output-len $OUTPUT_LEN --request-rate $rate --goodput ttft:500 tpot:50 --num-warmups 4 --seed $seed \
      --save-result "$OUT/$preset-rate-$rate.json" > "$OUT/$preset-rate-$rate.txt" 2>&1
    python - "$before" "$(cpu_snapshot)" "$t0" "$(date +%s.%N)" > "$OUT/$preset-rate-$rate-cpu.json" <<'PY'
import json, sys
before, after, wall = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
print(json.dumps({"wall_s": wall, "processes": [{"pid": p, "command": cmd, "cpu_s": cpu - before[p][0],
                  "busy_fraction_of_a_core": (cpu - before[p][0]) / wall} for p, (cpu, cmd) in after.items()
                 if p in before]}, indent=1))
PY
    tail -n 30 "$OUT/$preset-rate-$rate.txt" | grep -iE "throughput|P99|goodput|client cpu" | head -9
  done
  kill -TERM $pid; wait $pid; pid=
  spy=; [ "${PYSPY:-0}" = 1 ] && spy="py-spy record -r 250 -f raw --idle --nonblocking -o $OUT/$preset-pyspy-offline.txt --"
  $spy python -m brrr bench serve-overhead --result "$OUT/$preset-rate-inf.json" --model "$dir" $ENGINE ${TRACE:+--trace $OUT/$preset-offline-trace.jsonl} | tee -a "$OUT/overhead.jsonl"
done
