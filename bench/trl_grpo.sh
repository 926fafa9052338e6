#!/usr/bin/env bash
# `brrr bench rl` and TRL's GRPOTrainer (bench/trl_grpo.py) on the same model, prompts, counts and reward, one after
# the other in one device call; both append to one JSON-lines file (issue 56: brrr's rollout_tok_s beside TRL's
# generation_tok_s, step by step). A preset's random weights are drawn with the same seed on the same device by
# both sides (brrr.bench.rl.model_dir), so both read the same values.
#   bash bench/trl_grpo.sh fetch                 # here, where pip reaches PyPI: TRL's wheels into .whl/ (git-ignored)
#   bash bench/trl_grpo.sh run OUTFILE [FLAGS]   # on the GPU machine, from the repo root, with .whl carried
# FLAGS (both sides take them) default to the setup:
#   --model qwen3-0.6b --num-prompts 16 --num-generations 8 --max-completion-length 256 --steps 2
# Device call: run(command="bash bench/trl_grpo.sh run $OUT/rl_peer.jsonl", carry=[".whl"]).
# Env: TRL_SITE (where the wheels go, /tmp/trl_site).
set -euo pipefail
WHEELS="trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1"  # bench/trl_grpo.py's docstring says why
case ${1:-} in
  fetch)
    rm -f .whl/trl-*.whl .whl/datasets-*.whl .whl/multiprocess-*.whl .whl/dill-*.whl
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .whl $WHEELS
    ls -l .whl ;;
  run)
    [ $# -ge 2 ] || { echo "usage: trl_grpo.sh run OUTFILE [FLAGS]" >&2; exit 2; }
    OUTFILE=$2; shift 2
    FLAGS=("$@")
    [ ${#FLAGS[@]} -gt 0 ] || FLAGS=(--model qwen3-0.6b --num-prompts 16 --num-generations 8
                                      --max-completion-length 256 --steps 2)
    SITE=${TRL_SITE:-/tmp/trl_site}
    if [ ! -d "$SITE/trl" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .whl/trl-*.whl .whl/datasets-*.whl .whl/multiprocess-*.whl .whl/dill-*.whl
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    python3 -m brrr bench rl "${FLAGS[@]}" --out "$OUTFILE"
    python3 bench/trl_grpo.py "${FLAGS[@]}" --out "$OUTFILE" ;;
  *) echo "usage: trl_grpo.sh fetch | run OUTFILE [FLAGS]" >&2; exit 2 ;;
esac
