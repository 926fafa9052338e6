"""`brrr bench latency` on a brrr-trained model: it loads the directory's weights (random ones only when asked),
and its code and edit workloads are held-out text of the data build's validation split, in the model's tokens."""
import json

import pytest
from safetensors import safe_open

import brrr.bench.latency
import brrr.engine
from brrr.bench.latency_workloads import EDIT_MARKER, HeldOutText, Workload
from brrr.cli import main
from brrr.errors import BrrrError
from brrr.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def trained(trained_target):
    return trained_target


def split_texts(data_dir, source_dir, split):
    files = json.loads((data_dir / "manifest.json").read_text())["files"]
    return [(source_dir / f["path"]).read_text() for f in files if f["split"] == split]


@pytest.mark.parametrize("model", ["trained", "default"])
def test_code_prompts_are_windows_of_held_out_files(model, trained, data_dir, source_dir):
    """In the data's own tokens (the trained model's tokenizer), or decoded and encoded again by another one's."""
    from brrr.hub import resolve_model

    tok = Tokenizer.from_dir(trained if model == "trained" else resolve_model(None))
    workload = Workload("code", 40, tok.vocab_size, HeldOutText(data_dir, tok))
    prompts = workload.prompts(6, seed=1)
    assert workload.prompts(6, seed=1) == prompts and workload.prompts(6, seed=2) != prompts
    val = split_texts(data_dir, source_dir, "val")
    assert val and "validation split" in workload.source
    for p in prompts:
        assert len(p) == 40
        assert any(tok.decode(p, skip_special_tokens=False) in text for text in val)
    assert len({tuple(p) for p in prompts}) == 6


def test_edit_prompts_restate_a_held_out_passage(trained, data_dir, source_dir):
    tok = Tokenizer.from_dir(trained)
    marker = tok.encode(EDIT_MARKER, add_special_tokens=False)
    prompt_len = 60
    (prompt,) = Workload("edit", prompt_len, tok.vocab_size, HeldOutText(data_dir, tok)).prompts(1, seed=0)
    passage_len = (prompt_len - len(marker)) * 4 // 5
    head = prompt_len - len(marker) - passage_len
    assert len(prompt) == prompt_len and head > 0
    assert prompt[passage_len: passage_len + len(marker)] == marker
    assert prompt[passage_len + len(marker):] == prompt[:head]  # the answer starts by restating the passage
    val = split_texts(data_dir, source_dir, "val")
    assert any(tok.decode(prompt[:passage_len], skip_special_tokens=False) in text for text in val)


def test_text_file_and_bad_input(trained, data_dir, tmp_path, capsys):
    tok = Tokenizer.from_dir(trained)
    text = tmp_path / "held_out.py"
    text.write_text("def area(r):\n    return 3.14159 * r * r\n" * 20)
    (prompt,) = Workload("code", 24, tok.vocab_size, HeldOutText(text, tok)).prompts(1, seed=0)
    assert len(prompt) == 24 and tok.decode(prompt) in text.read_text()
    with pytest.raises(BrrrError, match="--workload code needs held-out text: --dataset-path"):
        Workload("code", 24, tok.vocab_size)
    with pytest.raises(BrrrError, match="no held-out document has 100000 tokens; lower --prompt-len"):
        Workload("code", 100000, tok.vocab_size, HeldOutText(data_dir, tok)).prompts(1, seed=0)
    with pytest.raises(BrrrError, match="--dataset-path .* is neither"):
        HeldOutText(tmp_path / "missing", tok)
    with pytest.raises(BrrrError, match="beyond the model's vocabulary"):
        Workload("code", 24, 8, HeldOutText(text, tok)).prompts(1, seed=0)
    assert main(["bench", "latency", "--model", str(trained), "--dataset-path", str(data_dir)]) != 0
    assert "--dataset-path is for --workload code or edit" in capsys.readouterr().err


def latency(trained, data_dir, out, *flags, prompt_len=40):
    assert main(["bench", "latency", "--model", str(trained), "--batch", "1,2", "--prompt-len", str(prompt_len),
                 "--new-tokens", "12", "--dtype", "float32", "--cpu-threads", "1", "--dataset-path", str(data_dir),
                 "--out", str(out), *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_bench_loads_the_trained_weights_unless_dummy(trained, data_dir, tmp_path, monkeypatch):
    engines = []

    class Recording(brrr.engine.LLMEngine):
        def __init__(self, model, *args, **kwargs):
            engines.append(model)
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(brrr.bench.latency, "LLMEngine", Recording)  # the engine the bench builds
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    for load_format, weights, equal in (("auto", "loaded", True), ("dummy", "random", False)):
        out = tmp_path / f"{load_format}.jsonl"
        records = latency(trained, data_dir, out, "--workload", "code", "--load-format", load_format)
        assert [r["weights"] for r in records] == [weights] * 2
        assert engines[-1].model.embed_tokens.weight.equal(embed) == equal


def test_bench_speculates_on_held_out_code_and_edits(trained, data_dir, tmp_path):
    """The target as its own draft model agrees with itself: every draft token is accepted, and the record puts
    calc spec's prediction (c = 1 on the roofline: the same model) beside it."""
    draft = json.dumps({"method": "draft", "num_speculative_tokens": 4, "model": str(trained)})
    records = latency(trained, data_dir, tmp_path / "draft.jsonl", "--workload", "code", "--num-iters", "2",
                      "--speculative-config", draft)
    for r in records:
        assert r["workload"] == "code" and "validation split" in r["workload_source"] and r["num_iters"] == 2
        assert r["acceptance_rate"] > 0.9 and r["cost_ratio_roofline"] == 1.0
        assert r["predicted_speedup"] == round(r["mean_accepted_length"] / 5, 3)
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    records = latency(trained, data_dir, tmp_path / "edit.jsonl", "--workload", "edit", "--speculative-config", ngram,
                      prompt_len=64)  # room for the marker (25 tokens in this tiny vocabulary)
    for r in records:
        assert r["workload"] == "edit" and r["spec_num_draft_tokens"] > 0
        assert r["predicted_speedup"] == r["predicted_speedup_c0"] == r["mean_accepted_length"]
