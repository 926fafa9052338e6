"""A small directory of Python files written by the test, and a data build of it, shared by the train tests."""
import json

import pytest

from brrr.train.data import build

TINY_MODEL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def write_sources(root, files=48):
    """Varied, valid Python: functions, classes, loops, docstrings; one file spells a special token as text."""
    ops = ["+", "-", "*", "//", "%"]
    for i in range(files):
        pkg = root / f"pkg{i % 4}"
        pkg.mkdir(parents=True, exist_ok=True)
        body = [f'"""Module {i}: helpers for item {i}."""', "import math", ""]
        for j in range(3):
            op = ops[(i + j) % len(ops)]
            body += [f"def compute_{i}_{j}(x, y={j + 1}):",
                     f'    """Return x {op} y, then scaled."""',
                     f"    total = x {op} y",
                     f"    for k in range({i % 5 + 1}):",
                     f"        total += k * {j}",
                     "    return total", ""]
        body += [f"class Thing{i}:", f"    size = {i * 7}", "", "    def __init__(self, name):",
                 "        self.name = name", "", "    def area(self):", "        return math.pi * self.size ** 2", ""]
        if i == 5:
            body.append('MARKER = "<|bos|> is a special token spelled out as text"')
        (pkg / f"mod_{i}.py").write_text("\n".join(body) + "\n")
    (root / "pkg0" / "empty.py").write_text("\n")
    (root / "pkg1" / "copy_of_mod_1.py").write_text((root / "pkg1" / "mod_1.py").read_text())  # a duplicate
    (root / "pkg2" / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8
    (root / "README.txt").write_text("not python")


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    write_sources(root)
    return root


@pytest.fixture(scope="session")
def data_dir(source_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    build(out, [str(source_dir)], vocab=400, val_fraction=0.2, show_progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(TINY_MODEL))
    return path


@pytest.fixture(scope="session")
def trained_target(tiny_config, data_dir, tmp_path_factory):
    """A tiny model trained 30 steps on data_dir (a speculation target, a bench's loaded weights)."""
    from brrr.train.trainer import TrainConfig, Trainer

    out = tmp_path_factory.mktemp("trained-target")
    Trainer(TrainConfig(str(tiny_config), str(data_dir), str(out), device="cpu", seq_len=32, micro_batch=4,
                        max_steps=30, lr=3e-3, warmup_steps=5, eval_every=30, eval_windows=2, log_every=10,
                        checkpoint_every=30, final_eval_windows=2)).run()
    return out
