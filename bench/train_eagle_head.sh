#!/usr/bin/env bash
# An EAGLE head for a small brrr-trained target, start to finish on one GPU in about BUDGET seconds: data from this
# machine's Python stdlib + site-packages, the target (the shipped default model's recipe, brrr-default shape,
# given a third of the budget), `brrr train-draft` (what is left), then `brrr calc spec` with the head's measured
# acceptance per position. Run from the repo root: PYTHONPATH=$PWD bash bench/train_eagle_head.sh DIR
# Knobs (environment): BUDGET (seconds, default 540).
set -euo pipefail
DIR=${1:?usage: train_eagle_head.sh OUT_DIR}
BUDGET=${BUDGET:-540}
mkdir -p "$DIR"
start=$(date +%s)
python3 -m brrr data build --out "$DIR/data" --source stdlib site-packages --vocab 8192 --quiet 2>&1 | tee "$DIR/data_build.log"
left=$(( BUDGET - ($(date +%s) - start) - 20 ))
python3 -m brrr train --config brrr-default --data "$DIR/data" --out "$DIR/target" \
    --seq-len 1024 --micro-batch 128 --lr 2e-3 --warmup-steps 200 --max-steps 3500 --eval-every 500 \
    --eval-windows 16 --final-eval-windows 64 --log-every 100 --checkpoint-every 1000 --compile \
    --export-dtype bfloat16 --time-budget $(( left / 2 )) 2>&1 | tee "$DIR/target.log"
left=$(( BUDGET - ($(date +%s) - start) - 20 ))
python3 -m brrr train-draft --target "$DIR/target" --data "$DIR/data" --out "$DIR/eagle" \
    --seq-len 1024 --micro-batch 32 --lr 1e-3 --warmup-steps 100 --max-steps 6000 --eval-every 500 \
    --eval-windows 16 --log-every 100 --checkpoint-every 2000 --time-budget $left 2>&1 | tee "$DIR/eagle.log"
rates=$(python3 -c "import json, sys; a = json.load(open(sys.argv[1]))['acceptance']['acceptance_per_position']
print(','.join(f'{r:.4f}' for r in a))" "$DIR/eagle/train_summary.json")
python3 -m brrr calc spec --acceptance "$rates" --target "$DIR/target" --draft eagle --gpu h100 \
    | tee "$DIR/calc_spec.txt"
python3 -m brrr calc spec --acceptance "$rates" --target "$DIR/target" --draft eagle --gpu h100 --json \
    > "$DIR/calc_spec.json"
