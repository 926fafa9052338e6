"""`brrr data build`: stable split, token counts that match the tokenizer, token files that decode to the text."""
import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from brrr import BrrrError
from brrr.token_data import TokenData
from brrr.train.data import build, split_of
from brrr.train.sampler import TrainWindows, eval_windows
from tests.train.conftest import write_sources


def _encoder(path):
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def test_split_is_a_stable_function_of_the_relative_path(tmp_path, data_dir, source_dir):
    # sha256 decides: the same path lands in the same split on any machine (values fixed by the hash)
    assert [split_of(p, 0.05) for p in ("json/decoder.py", "asyncio/tasks.py", "os.py")] == \
        [_by_hash(p, 0.05) for p in ("json/decoder.py", "asyncio/tasks.py", "os.py")]
    assert split_of("a.py", 0.999999) == "val" and split_of("a.py", 1e-9) == "train"
    # the same files under another root, built again: identical split, token files and tokenizer
    moved = tmp_path / "elsewhere" / "src"
    shutil.copytree(source_dir, moved)
    again = build(tmp_path / "again", [str(moved)], vocab=400, val_fraction=0.2, show_progress=False)
    first = json.loads((data_dir / "manifest.json").read_text())
    assert [(f["path"], f["split"], f["tokens"]) for f in again["files"]] == \
        [(f["path"], f["split"], f["tokens"]) for f in first["files"]]
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (data_dir / name).read_bytes()
    assert {f["split"] for f in first["files"]} == {"train", "val"}


def _by_hash(path, fraction):
    return "val" if int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") < fraction * 2**64 else "train"


def test_token_counts_match_the_tokenizer_and_tokens_decode_to_the_text(data_dir, source_dir):
    data = TokenData(data_dir)
    m, tok = data.manifest, _encoder(data_dir)
    assert m["skipped_files"] == {"duplicate": 1, "not_utf8": 1, "too_large": 0, "empty": 1}
    assert len(m["files"]) == 48
    bos, eos = m["special_tokens"]["bos"], m["special_tokens"]["eos"]
    for split in ("train", "val"):
        files = [f for f in m["files"] if f["split"] == split]
        offsets = data.documents(split)
        tokens = data.splits[split]
        assert len(offsets) == len(files) + 1 and offsets[-1] == len(tokens) == m["splits"][split]["tokens"]
        for f, start, end in zip(files, offsets[:-1], offsets[1:]):
            text = (source_dir / f["path"]).read_text()
            ids = tokens[int(start):int(end)]
            assert f["tokens"] == len(ids) == len(tok.encode(text, add_special_tokens=False).ids) + 2
            assert ids[0] == bos and ids[-1] == eos
            assert tok.decode(ids[1:-1].tolist(), skip_special_tokens=False) == text
    marker = next(f for f in m["files"] if f["path"] == "pkg1/mod_5.py")  # '<|bos|>' inside it stays text
    assert marker["tokens"] > 0
    split_tokens = data.splits[marker["split"]]
    assert int((split_tokens == bos).sum()) == m["splits"][marker["split"]]["docs"]
    assert m["tokenizer_sha256"] == hashlib.sha256((data_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert m["vocab_size"] == 400 and m["dtype"] == "uint16"


def test_windows_cover_each_epoch_and_shard_by_rank(data_dir):
    tokens = TokenData(data_dir).splits["train"]
    one = TrainWindows(tokens, 16, batch=4, seed=3)
    epoch = np.concatenate([one.window_indices(p) for p in range(one.windows // 4)])
    assert len(set(epoch.tolist())) == len(epoch)  # no window twice within an epoch
    ranks = [TrainWindows(tokens, 16, batch=2, seed=3, rank=r, world=2) for r in range(2)]
    assert np.array_equal(np.concatenate([r.window_indices(7) for r in ranks]), one.window_indices(7))
    x, y = one.batch_at(5, "cpu")
    assert x.shape == y.shape == (4, 16) and np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    starts, length = eval_windows(100, 1000, 64, max_windows=5)
    assert length == 65 and len(starts) == 5 and starts[0] == 100 and starts[-1] + 65 <= 1000


def test_bad_input_is_a_clear_error(tmp_path, tiny_config, data_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no python here")
    with pytest.raises(BrrrError, match="no usable .py files"):
        build(tmp_path / "out", [str(tmp_path / "empty")], show_progress=False)
    with pytest.raises(BrrrError, match="is not 'stdlib', 'site-packages' or a directory"):
        build(tmp_path / "out", [str(tmp_path / "missing")], show_progress=False)
    with pytest.raises(BrrrError, match="has no manifest.json"):
        TokenData(tmp_path / "empty")
    from brrr.train.trainer import TrainConfig, Trainer

    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.loads(tiny_config.read_text()), "vocab_size": 300}))
    too_small = r"'vocab_size' \(300\) is smaller than the data's tokenizer vocabulary \(400\)"
    with pytest.raises(BrrrError, match=too_small):
        Trainer(TrainConfig(str(small), str(data_dir), str(tmp_path / "run")))
    cli = subprocess.run([sys.executable, "-m", "brrr", "train", "--config", str(tiny_config), "--data",
                          str(tmp_path / "empty"), "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert cli.returncode == 2 and "has no manifest.json" in cli.stderr and "Traceback" not in cli.stderr


def test_data_build_cli(tmp_path):
    write_sources(tmp_path / "src", files=6)
    r = subprocess.run([sys.executable, "-m", "brrr", "data", "build", "--out", str(tmp_path / "d"), "--source",
                        str(tmp_path / "src"), "--vocab", "300", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "6 files" in r.stdout and (tmp_path / "d" / "manifest.json").is_file()
