#!/usr/bin/env bash
# Makes brrr's shipped default model (brrr/assets/default-model) on one GPU, start to finish, in BUDGET seconds:
# data from this machine's Python stdlib + site-packages, then `brrr train` sized by --time-budget to what is
# left, then greedy samples. Run from the repo root: PYTHONPATH=$PWD bash bench/train_default_model.sh DIR
# Knobs (environment): BUDGET (seconds, default 540), SOURCES (default "stdlib site-packages"), MICRO_BATCH (128), MAX_STEPS (3500).
set -euo pipefail
DIR=${1:?usage: train_default_model.sh OUT_DIR}
BUDGET=${BUDGET:-540}
SOURCES=${SOURCES:-stdlib site-packages}
MICRO_BATCH=${MICRO_BATCH:-128}
MAX_STEPS=${MAX_STEPS:-3500}  # ~460M tokens: about 4 epochs of this machine's ~110M; --time-budget may cap it
mkdir -p "$DIR"
start=$(date +%s)
python3 -m brrr data build --out "$DIR/data" --source $SOURCES --vocab 8192 --quiet 2>&1 | tee "$DIR/data_build.log"
used=$(( $(date +%s) - start ))
echo "data build took ${used}s" | tee -a "$DIR/data_build.log"
python3 -m brrr train --config brrr-default --data "$DIR/data" --out "$DIR/model" \
    --seq-len 1024 --micro-batch $MICRO_BATCH --grad-accum 1 --lr 2e-3 --min-lr-ratio 0.1 --warmup-steps 200 \
    --weight-decay 0.1 --grad-clip 1.0 --max-steps $MAX_STEPS --eval-every 250 --eval-windows 64 --log-every 50 \
    --checkpoint-every 1000 --compile --export-dtype bfloat16 --time-budget $(( BUDGET - used - 25 )) \
    2>&1 | tee "$DIR/train.log"
for prompt in "def fibonacci(n):" "import os
def list_python_files(root):" "class Stack:"; do
    echo "=== $prompt" >> "$DIR/samples.txt"
    python3 -m brrr generate "$prompt" --model "$DIR/model" --temperature 0 --max-tokens 96 \
        >> "$DIR/samples.txt" 2>>"$DIR/samples.err" || echo "(generate failed: see samples.err)" >> "$DIR/samples.txt"
done
cat "$DIR/samples.txt"
