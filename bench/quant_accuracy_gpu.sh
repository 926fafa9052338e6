#!/usr/bin/env bash
# Issue 8's accuracy table on a model larger than the default one, made by brrr's own pipeline on one GPU in about
# BUDGET seconds: `brrr data build` (this machine's Python source), `brrr train` (a 768-wide, 12-layer Llama, 82M
# parameters, 11x brrr-default; --time-budget gets what the other phases leave), `brrr quantize` with every method,
# then `brrr eval compare` on held-out tokens (the val split: files the tokenizer, the training and the
# calibration never saw) in fp32 and in bf16 compute.
#   PYTHONPATH=$PWD BUDGET=540 bash bench/quant_accuracy_gpu.sh RESULTS_DIR
# RESULTS_DIR gets 8 small files: accuracy.md (tables, targets, phase times), compare_fp32.json, compare_bf16.json,
# quantize.jsonl, train_summary.json, train_log.jsonl, model_config.json, run.log. Data, checkpoints and quantized
# models go to WORK (default /tmp/brrr_quant_accuracy), so RESULTS_DIR stays small enough to copy back.
# Knobs (environment) are below. A two-minute CPU run of the whole path with a tiny model: BUDGET=200 RESERVE=120
# DEVICE=cpu COMPILE=0 SOURCES=stdlib HIDDEN=128 LAYERS=2 HEADS=2 KV_HEADS=1 FFN=256 SEQ_LEN=256 MICRO_BATCH=4
# MAX_STEPS=30 WARMUP=5 CALIB_SAMPLES=8 EVAL_TOKENS=4096 WINDOW=256 STRIDE=128.
set -euo pipefail
DIR=${1:?usage: quant_accuracy_gpu.sh RESULTS_DIR}
WORK=${WORK:-/tmp/brrr_quant_accuracy}
BUDGET=${BUDGET:-540}          # seconds for the whole script
RESERVE=${RESERVE:-280}        # kept after training: quantize (88 s on the H200), fp32 eval (~130 s), bf16 eval (~25 s)
DEVICE=${DEVICE:-cuda}
SOURCES=${SOURCES:-stdlib site-packages}
TOKENIZER_MB=${TOKENIZER_MB:-64}  # BPE trained on 64 MB instead of 256: ~20 s less, the same Python tokens
# 768 wide (a multiple of 128, so int4 g128 applies to every projection; smollm2-135m's 576 is not), 12 layers,
# 12 query / 4 KV heads of 64, SwiGLU 2048, vocabulary 8192 tied: 81.8M parameters
HIDDEN=${HIDDEN:-768}; LAYERS=${LAYERS:-12}; HEADS=${HEADS:-12}; KV_HEADS=${KV_HEADS:-4}; FFN=${FFN:-2048}
SEQ_LEN=${SEQ_LEN:-1024}; MICRO_BATCH=${MICRO_BATCH:-64}; LR=${LR:-1e-3}; WARMUP=${WARMUP:-150}
MAX_STEPS=${MAX_STEPS:-100000}  # the time budget decides; this is only a ceiling
EVAL_WINDOWS=${EVAL_WINDOWS:-32}; FINAL_EVAL_WINDOWS=${FINAL_EVAL_WINDOWS:-256}  # per source, of SEQ_LEN tokens
COMPILE=${COMPILE:-1}
GROUP=${GROUP:-128}
CALIB_SAMPLES=${CALIB_SAMPLES:-128}; CALIB_SEQ_LEN=${CALIB_SEQ_LEN:-256}  # 32k tokens of the train split
EVAL_TOKENS=${EVAL_TOKENS:-65536}; WINDOW=${WINDOW:-512}; STRIDE=${STRIDE:-256}
BF16_EVAL=${BF16_EVAL:-1}
BF16_EVAL_S=${BF16_EVAL_S:-45}  # the bf16 table is skipped (loudly) unless this much of BUDGET + 40 s is left
export PYTHONUNBUFFERED=1 PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$DIR" "$WORK"
for name in accuracy.md compare_fp32.json compare_bf16.json quantize.jsonl train_summary.json train_log.jsonl \
        model_config.json; do
    rm -f "$DIR/$name"  # nothing left from an earlier run in the same directory
done
rm -f "$WORK/phases.tsv"
exec > >(tee "$DIR/run.log") 2>&1
T0=$(date +%s)
last=$T0
phase() {  # name: log the seconds since the previous phase ended
    local now
    now=$(date +%s)
    printf '%s\t%d\t%d\n' "$1" $((now - last)) $((now - T0)) >> "$WORK/phases.tsv"
    echo "=== phase $1: $((now - last))s (total $((now - T0))s of $BUDGET)"
    last=$now
}
commit=$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo '?')
echo "=== $(date -u +%FT%TZ) brrr $commit; WORK=$WORK"
python3 -c "import torch; print('torch', torch.__version__, '|', torch.get_num_threads(), 'CPU threads')"
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# 1. data: the train split feeds training and calibration, the val split (other files) the evaluation
rm -rf "$WORK/data"
python3 -m brrr data build --out "$WORK/data" --source $SOURCES --vocab 8192 --tokenizer-sample-mb "$TOKENIZER_MB" \
    --quiet
phase data

# 2. train, with whatever BUDGET leaves after RESERVE
cat > "$DIR/model_config.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $HIDDEN, "intermediate_size": $FFN,
 "num_hidden_layers": $LAYERS, "num_attention_heads": $HEADS, "num_key_value_heads": $KV_HEADS,
 "head_dim": $((HIDDEN / HEADS)), "max_position_embeddings": $SEQ_LEN, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
 "tie_word_embeddings": true, "vocab_size": null}
EOF
train_budget=$((BUDGET - ($(date +%s) - T0) - RESERVE - 5))  # 5: the trainer's start, outside its own budget
if [ "$train_budget" -lt 30 ]; then
    echo "only ${train_budget}s left for training (BUDGET $BUDGET, RESERVE $RESERVE): raise BUDGET" >&2
    exit 1
fi
rm -rf "$WORK/model"
python3 -m brrr train --config "$DIR/model_config.json" --data "$WORK/data" --out "$WORK/model" --device "$DEVICE" \
    --seq-len "$SEQ_LEN" --micro-batch "$MICRO_BATCH" --grad-accum 1 --lr "$LR" --min-lr-ratio 0.1 \
    --warmup-steps "$WARMUP" --weight-decay 0.1 --grad-clip 1.0 --max-steps "$MAX_STEPS" --eval-every 250 \
    --eval-windows "$EVAL_WINDOWS" --final-eval-windows "$FINAL_EVAL_WINDOWS" --log-every 50 \
    --checkpoint-every 1000000 $([ "$COMPILE" = 1 ] && echo --compile) --export-dtype bfloat16 \
    --time-budget "$train_budget"
cp "$WORK/model/train_summary.json" "$WORK/model/train_log.jsonl" "$DIR/"
rm -rf "$WORK/model/checkpoint"  # optimizer state: not needed past training
phase train

# 3. quantize, in three lanes at once (each quantize is one process; its start, a few seconds, overlaps the others'
# work): GPTQ; AWQ then SmoothQuant (their forward passes on DEVICE; GPTQ's Hessians and solves and AWQ's searches run
# on the CPU, hence the thread split); the methods without calibration, which read only the weights, on the CPU.
rm -rf "$WORK/q"
quantize() {  # method device [args]: one JSON line (quantize's own, plus device and wall seconds) to quantize.jsonl
    local method=$1 device=$2 t0 out
    shift 2
    t0=$(date +%s.%N)
    out=$(python3 -m brrr quantize --model "$WORK/model" --method "$method" --group-size "$GROUP" --device "$device" \
          --out "$WORK/q/$method" "$@" | tail -n 1)
    python3 -c 'import json, sys, time; r = json.loads(sys.argv[1]); r.update(device=sys.argv[2],
wall_seconds=round(time.time() - float(sys.argv[3]), 1)); print(json.dumps(r))' "$out" "$device" "$t0" \
        | tee -a "$DIR/quantize.jsonl"
}
calib=(--calib "$WORK/data" --calib-samples "$CALIB_SAMPLES" --calib-seq-len "$CALIB_SEQ_LEN")
cpus=$(nproc)
(export OMP_NUM_THREADS=$(( cpus / 2 > 1 ? cpus / 2 : 1 ))
 quantize gptq "$DEVICE" "${calib[@]}") > "$WORK/quantize_gptq.log" 2>&1 &
lanes=($!)
(export OMP_NUM_THREADS=$(( cpus * 3 / 8 > 1 ? cpus * 3 / 8 : 1 ))
 quantize awq "$DEVICE" "${calib[@]}"
 quantize smoothquant "$DEVICE" "${calib[@]}") > "$WORK/quantize_awq_smoothquant.log" 2>&1 &
lanes+=($!)
(export OMP_NUM_THREADS=2
 for method in rtn-int8 fp8 rtn-int4 nf4 fp8-w8a8; do
     quantize "$method" cpu
 done) > "$WORK/quantize_cpu.log" 2>&1 &
lanes+=($!)
failed=0
for pid in "${lanes[@]}"; do
    wait "$pid" || failed=$?
done
cat "$WORK/quantize_gptq.log" "$WORK/quantize_awq_smoothquant.log" "$WORK/quantize_cpu.log"
if [ "$failed" != 0 ]; then
    echo "a quantize lane failed (exit $failed): its log is above" >&2
    exit 1
fi
phase quantize

# 4. evaluate: the same val tokens and windows for every model; the first model (bf16 weights) is the baseline
MODELS=("$WORK/model")
for method in rtn-int8 fp8 rtn-int4 awq gptq nf4 smoothquant fp8-w8a8; do
    MODELS+=("$WORK/q/$method")
done
evaluate() {  # dtype
    python3 -m brrr eval compare --models "${MODELS[@]}" --data "$WORK/data" --split val --max-tokens "$EVAL_TOKENS" \
        --window "$WINDOW" --stride "$STRIDE" --device "$DEVICE" --dtype "$1" --json "$DIR/compare_$2.json"
}
report() {
    python3 - "$DIR" "$WORK" "$BUDGET" "$CALIB_SAMPLES" "$CALIB_SEQ_LEN" <<'EOF'
import json, sys
from pathlib import Path

from brrr.token_data import TokenData

out, work, budget, calib = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:6]
cfg = json.loads((out / "model_config.json").read_text())
train = json.loads((out / "train_summary.json").read_text())
quant = {r["method"]: r for r in map(json.loads, (out / "quantize.jsonl").read_text().splitlines())}
lines = [f"# Quantization accuracy: a {train['params'] / 1e6:.1f}M-parameter model trained by brrr", "",
         f"Model: {cfg['hidden_size']} wide, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} query / "
         f"{cfg['num_key_value_heads']} KV heads, SwiGLU {cfg['intermediate_size']}, vocabulary 8192 (tied); "
         f"trained {train['steps']} steps, {train['tokens_seen'] / 1e6:.0f}M tokens ({train['epochs']:.2f} epochs) "
         f"in {train['train_seconds']:.0f} s on {train['gpu']}, val ppl {train['val_ppl']:.3f}; exported in bf16.", ""]
for dtype in ("fp32", "bf16"):
    path = out / f"compare_{dtype}.json"
    if not path.is_file():
        lines += [f"({dtype} compute: not measured in this run)", ""]
        continue
    cmp = json.loads(path.read_text())
    ranges = TokenData(cmp["data"]).source_ranges(cmp["split"])
    n = cmp["rows"][0]["tokens"] + 1
    sources = ", ".join(f"{name} {min(end, n) - start:,}" for name, (start, end) in ranges.items() if start < n)
    lines += [f"## {dtype} compute ({cmp['device']})", "",
              f"Perplexity of the first {n:,} tokens of the val split (tokens per source: {sources}), window "
              f"{cmp['window']}, stride {cmp['stride']}; int4 is g{quant['rtn-int4']['group_size']} asymmetric; "
              f"calibration (gptq, awq, smoothquant): the first {calib[0]} x {calib[1]} tokens of the train split.",
              "",
              "| method | bits/weight | size on disk | perplexity | delta vs bf16 | quantize s (wall s, device) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ppl = {}
    for r in cmp["rows"]:
        q = quant.get(r["method"])
        name = "none (bf16 weights)" if r["method"] == "none" else r["method"]
        cost = f"{q['seconds']:.1f} ({q['wall_seconds']:.0f}, {q['device']})" if q else ""
        delta = "" if r["method"] == "none" else f"{r['delta_pct']:+.2f}%"
        lines.append(f"| {name} | {r['bits_per_weight']:.2f} | {r['bytes'] / 1e6:.2f} MB | {r['ppl']:.4f} | {delta} "
                     f"| {cost} |")
        ppl[r["method"]] = r
    d = lambda m: ppl[m]["delta_pct"]  # noqa: E731
    p = lambda m: ppl[m]["ppl"]  # noqa: E731
    targets = [("rtn-int8 within +1% of bf16", d("rtn-int8") <= 1),
               ("smoothquant (W8A8) within +1% of bf16", d("smoothquant") <= 1),
               ("gptq g128 below rtn-int4 and within +5%", p("gptq") < p("rtn-int4") and d("gptq") <= 5),
               ("awq g128 below rtn-int4 and within +5%", p("awq") < p("rtn-int4") and d("awq") <= 5),
               ("nf4 between gptq and rtn-int4", p("gptq") <= p("nf4") <= p("rtn-int4"))]
    lines += ["", "Issue 8's targets: " + "; ".join(f"{t}: {'met' if ok else 'MISSED'}" for t, ok in targets) + ".",
              ""]
phases = [line.split("\t") for line in (work / "phases.tsv").read_text().splitlines()]
lines += ["Phases (s): " + ", ".join(f"{name} {s}" for name, s, _ in phases)
          + f"; total {phases[-1][2]} of a {budget} s budget.", ""]
(out / "accuracy.md").write_text("\n".join(lines))
print("\n".join(lines))
EOF
}
evaluate float32 fp32
phase eval_fp32
report
if [ "$BF16_EVAL" = 1 ]; then
    if [ $(( $(date +%s) - T0 + BF16_EVAL_S )) -le $((BUDGET + 40)) ]; then
        evaluate bfloat16 bf16
        phase eval_bf16
        report
    else
        echo "!!! bf16 eval SKIPPED: $(( $(date +%s) - T0 ))s used of BUDGET $BUDGET (it needs ~${BF16_EVAL_S}s)"
    fi
fi
echo "=== done in $(( $(date +%s) - T0 ))s; results in $DIR, data and models in $WORK"
