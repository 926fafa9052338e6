#!/usr/bin/env bash
# Speculative decoding measured on a real pair, in two runs of under 10 minutes each on one GPU (docs/speculative.md,
# "Measuring with a trained pair"). Run from the repo root with PYTHONPATH=$PWD.
#
#   bash bench/spec_trained.sh train DIR [REPORT]   data (this machine's Python source), the target (brrr-300m), the
#                                                   draft (brrr-default, same data and tokenizer) and the target's
#                                                   EAGLE head, each within its share of BUDGET seconds; REPORT
#                                                   (default DIR/report) gets the logs and summaries
#   bash bench/spec_trained.sh bench DIR OUT        `brrr bench latency` on held-out text of DIR/data: workloads code
#                                                   and edit, no speculation / ngram / draft / eagle at k = K, each at
#                                                   batch 1, 16 and 64; OUT/latency.jsonl and OUT/summary.md
#   bash bench/spec_trained.sh summary DIR OUT      OUT/summary.md again from OUT/latency.jsonl
#
# Knobs (environment). train: BUDGET (seconds, 560), SOURCES ("stdlib site-packages"), VOCAB (8192), TARGET_SHAPE
# (brrr-300m), DRAFT_SHAPE (brrr-default) - a shape name or a config.json -, SEQ_LEN (1024), TARGET_MICRO_BATCH
# (32), DRAFT_MICRO_BATCH (128), EAGLE_MICRO_BATCH (32), TARGET_SHARE and DRAFT_SHARE (percent of the time left
# after the data build: 55 and 15; the head gets the rest), COMPILE (1: torch.compile for the target; the 7M draft
# always trains eagerly: its compile can take most of its short budget).
# bench: BATCHES (1,16,64), PROMPT_LEN (512), NEW_TOKENS (256), NUM_ITERS (4), K (4), WORKLOADS ("code edit"),
# METHODS ("none eagle draft ngram"), SPEC_EXTRA (JSON members added to each speculative config, e.g.
# '"disable_by_batch_size": 16'), DTYPE (bfloat16), RUN_TIMEOUT (seconds per `brrr bench latency`, 150), BUDGET
# (seconds for the phase, 560: a run that would end later is cut short or skipped).
set -uo pipefail
PHASE=${1:?usage: spec_trained.sh train DIR [REPORT] | bench DIR OUT}
DIR=${2:?usage: spec_trained.sh train DIR [REPORT] | bench DIR OUT}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# step NAME SECONDS CMD...: CMD under `timeout` (never past the phase's DEADLINE), its output in LOGS/NAME.log and
# on stdout; a step that fails or runs out of time is reported and the phase goes on with what it has
step() {
    local name=$1 limit=$2
    shift 2
    local room=$(( DEADLINE - $(elapsed) ))
    (( limit > room )) && limit=$room
    if (( limit < 20 )); then
        echo "=== $name: skipped, ${room}s left of the phase" | tee -a "$LOGS/steps.txt"
        return 1
    fi
    echo "=== $name (limit ${limit}s, at $(elapsed)s)"
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    { echo "=== $name: exit $rc after $(elapsed)s"; [ "$rc" = 0 ] || tail -n 40 "$LOGS/$name.log"; } \
        | tee -a "$LOGS/steps.txt" > /dev/null
    echo "=== $name: exit $rc after $(elapsed)s"
    return $rc
}

train() {
    local report=${1:-$DIR/report}
    BUDGET=${BUDGET:-560}
    DEADLINE=$BUDGET
    SEQ_LEN=${SEQ_LEN:-1024}
    local compile=()
    [ "${COMPILE:-1}" = 1 ] && compile=(--compile)
    # a fresh run: this script's own outputs go (the trainers refuse to write over a run), nothing else in DIR
    rm -rf "$DIR/data" "$DIR/target" "$DIR/draft" "$DIR/eagle" "$DIR/bench_logs" && mkdir -p "$DIR" "$report"
    LOGS=$report
    : > "$LOGS/steps.txt"
    step data 180 python3 -m brrr data build --out "$DIR/data" --source ${SOURCES:-stdlib site-packages} \
        --vocab ${VOCAB:-8192} --tokenizer-sample-mb 64 --quiet || return 1
    # each trainer process starts (imports, CUDA, data) for ~10 s outside its --time-budget: kept out of the shares
    local left=$(( BUDGET - $(elapsed) - 30 ))
    local t_budget=$(( left * ${TARGET_SHARE:-55} / 100 - 10 )) d_budget=$(( left * ${DRAFT_SHARE:-15} / 100 - 10 ))
    step target $(( t_budget + 40 )) python3 -m brrr train --config ${TARGET_SHAPE:-brrr-300m} --data "$DIR/data" \
        --out "$DIR/target" --seq-len $SEQ_LEN --micro-batch ${TARGET_MICRO_BATCH:-32} --lr 1e-3 --min-lr-ratio 0.1 \
        --warmup-steps 100 --weight-decay 0.1 --grad-clip 1.0 --max-steps 20000 --eval-every 1000000 \
        --eval-windows 8 --final-eval-windows 32 --log-every 50 --checkpoint-every 1000000 "${compile[@]}" \
        --export-dtype bfloat16 --time-budget $t_budget  # without a target the head's step fails fast, saying so
    step draft $(( d_budget + 40 )) python3 -m brrr train --config ${DRAFT_SHAPE:-brrr-default} --data "$DIR/data" \
        --out "$DIR/draft" --seq-len $SEQ_LEN --micro-batch ${DRAFT_MICRO_BATCH:-128} --lr 2e-3 --min-lr-ratio 0.1 \
        --warmup-steps 200 --weight-decay 0.1 --grad-clip 1.0 --max-steps 3500 --eval-every 1000000 \
        --eval-windows 8 --final-eval-windows 32 --log-every 50 --checkpoint-every 1000000 \
        --export-dtype bfloat16 --time-budget $d_budget
    local e_budget=$(( BUDGET - $(elapsed) - 25 ))
    step eagle $(( e_budget + 20 )) python3 -m brrr train-draft --target "$DIR/target" --data "$DIR/data" \
        --out "$DIR/eagle" --seq-len $SEQ_LEN --micro-batch ${EAGLE_MICRO_BATCH:-32} --lr 1e-3 --warmup-steps 100 \
        --max-steps 20000 --eval-every 1000000 --eval-windows 8 --final-eval-windows 16 --log-every 50 \
        --checkpoint-every 1000000 --time-budget $e_budget
    # the head's acceptance per position (train-draft's own k = 8 check) through brrr calc spec
    if [ -f "$DIR/eagle/train_summary.json" ]; then
        local rates
        rates=$(python3 -c "import json, sys; a = json.load(open(sys.argv[1]))['acceptance']['acceptance_per_position']
print(','.join(f'{r:.4f}' for r in a))" "$DIR/eagle/train_summary.json")
        python3 -m brrr calc spec --acceptance "$rates" --target "$DIR/target" --draft eagle --gpu h100 --context 640 \
            > "$report/calc_spec_eagle.txt" 2>&1
    fi
    python3 - "$DIR" "$report/train_summaries.json" "$(elapsed)" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
out = {"seconds": int(sys.argv[3])}
for name in ("target", "draft", "eagle"):
    f = d / name / "train_summary.json"
    out[name] = json.loads(f.read_text()) if f.is_file() else None
m = d / "data" / "manifest.json"
if m.is_file():
    m = json.loads(m.read_text())
    out["data"] = {k: m[k] for k in ("vocab_size", "splits", "skipped_files", "tokenizer_training_bytes")}
Path(sys.argv[2]).write_text(json.dumps(out, indent=1) + "\n")
EOF
    echo "train phase: $(elapsed)s; models in $DIR/{target,draft,eagle}, report in $report"
}

# summarize OUT K: OUT/summary.md from OUT/latency.jsonl (also a phase of its own: `summary DIR OUT`)
summarize() {
    python3 - "$1/latency.jsonl" "$DIR/draft" "$2" > "$1/summary.md" <<'EOF'
import json, sys
from pathlib import Path
path, draft_dir, k = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
draft_alone = {r["batch"]: r["decode_tok_s"] for r in records if r["model"] == draft_dir}
runs = [r for r in records if r["model"] != draft_dir]
method = lambda r: r.get("speculative_config", {}).get("method", "none")
base = {(r["workload"], r["batch"]): r["decode_tok_s"] for r in runs if method(r) == "none"}
print(f"# speculative decoding, trained pair: k = {k}, {runs[0]['machine'] if runs else '?'}\n")
print("| workload | batch | method | tok/s | measured speedup | predicted (roofline c) | predicted (measured c) "
      "| acceptance rate | mean accepted length | per position | tokens / seq-step |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
speedup = {}
for r in runs:
    key, m = (r["workload"], r["batch"]), method(r)
    s = r["decode_tok_s"] / base[key] if key in base else None
    speedup[(r["workload"], r["batch"], m)] = s
    measured_c = ""
    if m == "draft" and r["batch"] in draft_alone and key in base:  # c = draft step / target step, both measured
        c = base[key] / draft_alone[r["batch"]]
        measured_c = f"{r['mean_accepted_length'] / (1 + k * c):.2f}x (c {c:.3f})"
    fmt = lambda v, f: "" if v is None else format(v, f)
    print(f"| {r['workload']} | {r['batch']} | {m} | {r['decode_tok_s']:,.0f} | {fmt(s, '.2f')} | "
          f"{fmt(r.get('predicted_speedup'), '.2f')} | {measured_c} | {fmt(r.get('acceptance_rate'), '.3f')} | "
          f"{fmt(r.get('mean_accepted_length'), '.2f')} | "
          f"{', '.join(fmt(a, '.2f') for a in r.get('acceptance_per_pos') or [] if a is not None)} | "
          f"{fmt(r.get('tokens_per_seq_step'), '.2f')} |")
print("\nThe issue's targets:")
for label, key, goal in (("EAGLE, batch 1, code", ("code", 1, "eagle"), 2.0),
                         ("n-gram, batch 1, edit", ("edit", 1, "ngram"), 1.8),
                         ("draft, batch 1, code", ("code", 1, "draft"), 1.5)):
    s = speedup.get(key)
    print(f"- {label}: >= {goal}x: " + ("not run" if s is None else f"{s:.2f}x, {'met' if s >= goal else 'NOT met'}"))
for w in ("code", "edit"):
    worst = [(s, m) for (w_, b, m), s in speedup.items() if w_ == w and b == 64 and m != "none" and s is not None]
    if worst:
        s, m = min(worst)
        print(f"- batch 64, {w}: no method below 0.97x: slowest {m} {s:.2f}x, {'met' if s >= 0.97 else 'NOT met'}")
EOF
}

bench() {
    local out=${1:?usage: spec_trained.sh bench DIR OUT}
    LOGS=$DIR/bench_logs  # one log per run stays here; $out gets steps.txt (each run's exit, a failed one's tail)
    rm -rf "$LOGS" && mkdir -p "$LOGS" "$out"
    rm -f "$out/latency.jsonl"
    : > "$LOGS/steps.txt"
    DEADLINE=${BUDGET:-560}
    local k=${K:-4} extra=${SPEC_EXTRA:-} common
    [ -n "$extra" ] && extra=", $extra"
    common=(--batch ${BATCHES:-1,16,64} --prompt-len ${PROMPT_LEN:-512} --new-tokens ${NEW_TOKENS:-256}
            --num-iters ${NUM_ITERS:-4} --dtype ${DTYPE:-bfloat16} --dataset-path "$DIR/data" --out "$out/latency.jsonl")
    for f in target draft eagle data; do
        [ -d "$DIR/$f" ] || echo "warning: $DIR/$f is missing (did the train phase finish?)"
    done
    for workload in ${WORKLOADS:-code edit}; do
        for method in ${METHODS:-none eagle draft ngram}; do
            local spec=()
            case $method in
                none) ;;
                ngram) spec=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $k$extra}") ;;
                draft|eagle) spec=(--speculative-config "{\"method\": \"$method\", \"num_speculative_tokens\": $k, \"model\": \"$DIR/$method\"$extra}") ;;
                *) echo "unknown method $method (none, ngram, draft, eagle)"; continue ;;
            esac
            step "$workload-$method" ${RUN_TIMEOUT:-150} python3 -m brrr bench latency --model "$DIR/target" \
                --workload "$workload" "${spec[@]}" "${common[@]}"
        done
    done
    # the draft's own decode step, in CUDA graphs as the proposer runs it: the measured cost ratio c beside the
    # roofline's (a 7M model's step is launch-bound, far above its bytes' share)
    step draft-alone ${RUN_TIMEOUT:-150} python3 -m brrr bench latency --model "$DIR/draft" --workload code \
        "${common[@]}"
    summarize "$out" "$k"
    cp "$LOGS/steps.txt" "$out/steps.txt"
    cat "$out/summary.md"
    echo "bench phase: $(elapsed)s; records in $out/latency.jsonl"
}

case $PHASE in
    train) train "${3:-}" ;;
    bench) bench "${3:?usage: spec_trained.sh bench DIR OUT}" ;;
    summary) summarize "${3:?usage: spec_trained.sh summary DIR OUT}" ${K:-4} && cat "$3/summary.md" ;;
    *) echo "usage: spec_trained.sh train DIR [REPORT] | bench DIR OUT" >&2; exit 2 ;;
esac
