#!/usr/bin/env bash
# The GPU measurements of #41 on one machine of GPUS H100s: llama-3.2-1b and llama-3.1-8b shapes (random weights,
# random tokens), sequence 4096, FSDP2 and FSDP2 x TP, one JSON record per layout appended to OUT.
# Run from the repo root: PYTHONPATH=$PWD bash bench/train_distributed.sh GPUS OUT [SHAPE]
#   SHAPE: 1b, 8b or both (default). 1B: micro-batch 2 per rank (4 per TP group), no recompute;
#   8B: micro-batch 1 per rank (2 per TP group), activation checkpointing (its state needs >= 2 GPUs).
# The global batch of one layout matches across its FSDP and FSDP x TP records, so they compare directly; the
# one-GPU record is the scaling-efficiency baseline (tokens/s per GPU at N GPUs / at one).
set -uo pipefail
GPUS=${1:?usage: train_distributed.sh GPUS OUT [1b|8b|both]}
OUT=${2:?usage: train_distributed.sh GPUS OUT [1b|8b|both]}
SHAPE=${3:-both}
run() {  # a layout that fails (OOM, a timeout) leaves a record saying so, and the next one still runs
    timeout 280 torchrun --nproc_per_node "$GPUS" --master-port $((29500 + RANDOM % 1000)) \
        bench/train_distributed.py --seq-len 4096 --compile --out "$OUT" "$@" \
        || echo "{\"bench\": \"train_distributed\", \"gpus\": $GPUS, \"failed\": \"$*\"}" >> "$OUT"
}
if [ "$SHAPE" != 8b ]; then
    run --model llama-3.2-1b --micro-batch 2
    [ "$GPUS" -ge 2 ] && run --model llama-3.2-1b --micro-batch 4 --tp 2
fi
if [ "$SHAPE" != 1b ] && [ "$GPUS" -ge 2 ]; then
    run --model llama-3.1-8b --micro-batch 1 --checkpointing
    run --model llama-3.1-8b --micro-batch 2 --tp 2 --checkpointing
fi
exit 0
