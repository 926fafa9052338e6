#!/usr/bin/env bash
# torchtitan 0.2.2 training brrr's llama-3.1-8b or llama-3.2-1b shape under torchrun, the peer of `brrr bench train`
# under torchrun (issue 41); appends one JSON record to OUTFILE (parse_titan.py). Runs from the bundle
# prepare.sh builds (wheels, tokenizer, text beside this script: no network needed), with brrr's repo root as the
# working directory (the parser reads brrr's FLOP count from there):
#   bash BUNDLE/run_titan.sh NPROC MODEL OUTFILE [torchtitan flags, e.g. --training.steps 20]
#   MODEL: llama-3.1-8b (flavor 8B, local batch 1, full AC) | llama-3.2-1b (flavor 1B, local batch 2, no AC)
# Env: TITAN_SITE (where the wheels go, /tmp/titan_site), TITAN_TIMEOUT (s, 300), TITAN_WARMUP (untimed steps, 5).
set -u
if [ $# -lt 3 ]; then echo "usage: run_titan.sh NPROC MODEL OUTFILE [torchtitan flags]" >&2; exit 2; fi
NPROC=$1 MODEL=$2 OUTFILE=$3; shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${TITAN_SITE:-/tmp/titan_site}
WARMUP=${TITAN_WARMUP:-5}
case $MODEL in
  llama-3.1-8b) CFG=llama3_8b.toml FLAVOR=8B LB=1 AC=full ;;
  llama-3.2-1b) CFG=llama3_1b.toml FLAVOR=1B LB=2 AC=none ;;
  *) echo "run_titan.sh: MODEL must be llama-3.1-8b or llama-3.2-1b, got '$MODEL'" >&2; exit 2 ;;
esac
if [ ! -f "$SITE/torchtitan/train.py" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$HERE"/whl/*.whl \
    || exit 1
fi
export PYTHONPATH="$SITE:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/titan_hf TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# torchtitan's own launcher (run_train.sh) sets this; brrr's bench does not unless the caller exports it too
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
python3 - <<'PY' || exit 1
import importlib.metadata as md
print("run_titan.sh: " + ", ".join(f"{n} {md.version(n)}" for n in
      ("torch", "torchtitan", "torchdata", "datasets", "pyarrow", "fsspec", "huggingface_hub", "tyro", "tokenizers")))
import torchtitan.train  # noqa: F401  (a missing or incompatible package fails here, before torchrun starts)
PY
DUMP=$(mktemp -d /tmp/titan_run.XXXXXX)
LOG=$DUMP/console.log
echo "run_titan.sh: $MODEL on $NPROC GPU(s), dump $DUMP"
timeout -k 20 ${TITAN_TIMEOUT:-300} torchrun --nproc_per_node "$NPROC" --rdzv_backend c10d --rdzv_endpoint localhost:0 \
  --local-ranks-filter 0 --role rank --tee 3 -m torchtitan.train \
  --job.config_file "$HERE/$CFG" --job.dump_folder "$DUMP" --model.hf_assets_path "$HERE/tokenizer" \
  --training.dataset_path "$HERE/c4_local" --experimental.custom_import brrr_titan_flavors "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# the device tool brings back what lands in $OUT
[ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && cp "$LOG" "$OUT/titan-$MODEL-$NPROC.log"
python3 "$HERE/parse_titan.py" --log "$LOG" --tb "$DUMP/tb" --model "$MODEL" --flavor "$FLAVOR" --nproc "$NPROC" \
  --seq-len 4096 --local-batch "$LB" --ac "$AC" --warmup "$WARMUP" --exit-code "$rc" \
  --alloc-conf "$PYTORCH_ALLOC_CONF" --out "$OUTFILE"
