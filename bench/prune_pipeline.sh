#!/usr/bin/env bash
# Prune -> distill -> quantize on brrr's shipped default model, on the CPU, and one `brrr eval compare` table of
# every stage (perplexity, bits per weight, sparsity, size). Calibration, training and evaluation text are
# different files of this interpreter's standard library. Run from the repo root:
#   PYTHONPATH=$PWD bash bench/prune_pipeline.sh DIR
# Knobs (environment): METHOD (sparsegpt), PATTERN (2:4), STEPS (100: distillation steps of 4 x 128 tokens),
# DEVICE (cpu). Skips the stages whose output directory exists (rerun a stage: delete its directory).
set -euo pipefail
DIR=${1:?usage: prune_pipeline.sh OUT_DIR}
METHOD=${METHOD:-sparsegpt}
PATTERN=${PATTERN:-2:4}
STEPS=${STEPS:-100}
DEVICE=${DEVICE:-cpu}
BASE=brrr/assets/default-model
S=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p "$DIR"
cat "$S"/argparse.py "$S"/dataclasses.py "$S"/functools.py > "$DIR/calib.txt"
cat "$S"/typing.py "$S"/inspect.py "$S"/subprocess.py "$S"/threading.py "$S"/logging/__init__.py \
    "$S"/collections/__init__.py "$S"/json/*.py "$S"/shutil.py "$S"/tempfile.py "$S"/enum.py > "$DIR/train.txt"
cat "$S"/textwrap.py "$S"/tokenize.py "$S"/pathlib.py > "$DIR/eval.txt"

# 1. prune: the projections to exactly 2 of every 4 weights, layer by layer on calibration activations
[ -d "$DIR/pruned" ] || python3 -m brrr prune --model $BASE --method "$METHOD" --pattern "$PATTERN" --calib "$DIR/calib.txt" \
    --device "$DEVICE" --out "$DIR/pruned" | tee "$DIR/prune.json"
# 2. distil: the dense model teaches its pruned self (the zeros stay), half KL at T = 2, half hard labels
[ -d "$DIR/distilled" ] || python3 -m brrr distill --teacher $BASE --student "$DIR/pruned" --data "$DIR/train.txt" --out "$DIR/distilled" \
    --kind forward --temperature 2 --alpha 0.5 --seq-len 128 --micro-batch 4 --max-steps "$STEPS" --lr 3e-4 \
    --warmup-steps 10 --eval-every 50 --eval-windows 16 --final-eval-windows 64 --log-every 25 \
    --checkpoint-every "$STEPS" --device "$DEVICE" > "$DIR/distill.log"
# 3. quantize: int8 weights (symmetric: a zero stays an exact zero) and GPTQ int4
[ -d "$DIR/distilled-int8" ] || python3 -m brrr quantize --model "$DIR/distilled" --method rtn-int8 --out "$DIR/distilled-int8" --device "$DEVICE"
[ -d "$DIR/distilled-gptq" ] || python3 -m brrr quantize --model "$DIR/distilled" --method gptq --calib "$DIR/calib.txt" --out "$DIR/distilled-gptq" \
    --device "$DEVICE"
python3 -m brrr eval compare --models $BASE "$DIR/pruned" "$DIR/distilled" "$DIR/distilled-int8" \
    "$DIR/distilled-gptq" --data "$DIR/eval.txt" --max-tokens 16384 --device "$DEVICE" --json "$DIR/compare.json"
