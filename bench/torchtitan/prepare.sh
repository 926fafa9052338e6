#!/usr/bin/env bash
# Builds the torchtitan bundle a GPU machine without network runs (bench/torchtitan/run_titan.sh): the wheels
# torchtitan 0.2.2 needs beyond the device image (KINDS.md's package list), a Llama-3 tokenizer, a few MB of text
# in the json-lines format of torchtitan's c4_test, and this folder's scripts. Run here, where pip reaches PyPI:
#   bash bench/torchtitan/prepare.sh BUNDLE TOKENIZER_DIR      # e.g. .scratch/titan DIR/with/tokenizer.json
# About 12 MB. torchtitan 0.2.2 (2026-02) is the release built against torch 2.11's nightlies (0.3.0 targets
# a later torch and needs spmd_types / torch_checkpointing); datasets 5.2.0 is the first to accept the image's
# huggingface_hub 1.x. The image already has tokenizers, tensorboard, einops, pillow, pyarrow, pandas, xxhash.
set -eu
if [ $# -ne 2 ]; then
  echo "usage: prepare.sh BUNDLE TOKENIZER_DIR (a folder with a Llama-3 tokenizer.json)" >&2; exit 2
fi
BUNDLE=$1 TOK=$2
HERE=$(cd "$(dirname "$0")" && pwd)
[ -f "$TOK/tokenizer.json" ] || { echo "prepare.sh: no tokenizer.json in $TOK" >&2; exit 2; }
mkdir -p "$BUNDLE/whl" "$BUNDLE/tokenizer" "$BUNDLE/c4_local"
rm -f "$BUNDLE"/whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$BUNDLE/whl" torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 shtab==1.13.0
cp "$HERE"/run_titan.sh "$HERE"/parse_titan.py "$HERE"/brrr_titan_flavors.py "$HERE"/llama3_*.toml "$BUNDLE/"
python3 - "$TOK" "$BUNDLE" <<'PY'
import glob, json, os, shutil, sys, sysconfig
tok, bundle = sys.argv[1], sys.argv[2]
# the tokenizer, re-serialized without indentation (half the bytes); 128,256 ids is Llama 3's vocabulary
spec = json.load(open(os.path.join(tok, "tokenizer.json")))
with open(os.path.join(bundle, "tokenizer", "tokenizer.json"), "w") as f:
    json.dump(spec, f, separators=(",", ":"), ensure_ascii=False)
config = os.path.join(tok, "tokenizer_config.json")
if os.path.exists(config):
    shutil.copy(config, os.path.join(bundle, "tokenizer"))
else:  # torchtitan reads BOS/EOS from here
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
              open(os.path.join(bundle, "tokenizer", "tokenizer_config.json"), "w"))
# text: this Python's standard library sources, one {"text": ...} line per file, about 3.5 MB (~0.8M tokens;
# torchtitan re-loops the data, and throughput does not depend on what the tokens are)
out = os.path.join(bundle, "c4_local", "data.json")
with open(out, "w") as f:
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        text = open(path, encoding="utf-8", errors="replace").read()[:40000]
        if len(text) >= 2000:
            f.write(json.dumps({"text": text}) + "\n")
        if f.tell() > 3_500_000:
            break
PY
du -sh "$BUNDLE"; ls "$BUNDLE"/whl
