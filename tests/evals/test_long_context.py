"""Long-context evaluation on the shipped default model (short contexts on CPU): `brrr eval ppl --context` scores
exactly windows x (L - 1) tokens a length and agrees with the sliding-window evaluator on a single window; a RoPE
scaling override changes the scores and 'none' gives them back; the passkey prompt holds its needle at the
requested depth (model-free); `brrr eval needle` fills its whole grid with rates in [0, 1]. Through the serving
engine (a --kv-* flag): the same scores with the model's own cache, an fp8 cache's at a quarter of fp32's bytes,
StreamingLLM's at its budget; the policies the scores cannot show, and windows past the engine's, refused by name."""
import json
import math

import pytest

import brrr
from brrr.cli import main
from brrr.errors import BrrrError
from brrr.evals.context_ppl import (context_perplexity, engine_context_perplexity, parse_contexts, stdlib_tokens,
                                    with_rope_scaling)
from brrr.evals.needle import ANSWER_TOKENS, NEEDLE, build_prompt, parse_depths
from brrr.quant.evaluate import perplexity


@pytest.fixture(scope="module")
def default():
    return brrr.load(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tokens(default):
    return stdlib_tokens(default.tokenizer, 1100)


def test_context_ppl_counts_every_windows_tokens_and_matches_the_sliding_evaluator(default, tokens):
    rows = context_perplexity(default.model, tokens, [256, 512])
    assert [(r["context"], r["windows"], r["tokens"]) for r in rows] == [(256, 4, 4 * 255), (512, 2, 2 * 511)]
    for r in rows:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and not r["beyond_max_context"]
        assert r["ppl"] == pytest.approx(math.exp(r["nll"]))
    # one window, scored by the other evaluator (its own batching and logits path)
    one = context_perplexity(default.model, tokens[:512], [512])[0]
    ref = perplexity(default.model, tokens[:512], window=512, stride=511)
    assert ref["tokens"] == one["tokens"] == 511
    assert one["nll"] == pytest.approx(ref["nll"], rel=1e-5)
    # a code model reads its context: 512-token windows predict their tokens better on average than 256-token ones
    assert rows[1]["nll"] < rows[0]["nll"]


def test_rope_scaling_override_changes_scores_and_none_restores_them(default, tokens):
    pre = default  # its plain RoPE is put back at the end (asserted)
    base = context_perplexity(pre.model, tokens, [256])[0]["nll"]
    cfg = with_rope_scaling(pre.model, '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256}')
    assert cfg.rope.type == "yarn" and pre.model.config.rope.params["factor"] == 4
    scaled = context_perplexity(pre.model, tokens, [256])[0]["nll"]
    assert abs(scaled - base) > 1e-3
    with_rope_scaling(pre.model, "none")
    assert context_perplexity(pre.model, tokens, [256])[0]["nll"] == pytest.approx(base, rel=1e-6)
    with pytest.raises(BrrrError, match="--rope-scaling must be 'none' or a JSON object"):
        with_rope_scaling(pre.model, "{yarn")


def test_contexts_and_depths_parse_with_clear_errors():
    assert parse_contexts("4k,8k,16k,32k") == [4096, 8192, 16384, 32768]
    assert parse_contexts("256, 512") == [256, 512]
    assert parse_depths("0,50,100") == [0.0, 0.5, 1.0]
    with pytest.raises(BrrrError, match="--context takes comma-separated lengths"):
        parse_contexts("4m")
    with pytest.raises(BrrrError, match=r"--depths must lie in \[0, 100\]"):
        parse_depths("0,150")


def _encode(text):  # one id per character: the prompt's arithmetic without a tokenizer
    return [ord(c) for c in text]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
def test_needle_prompt_holds_the_key_at_the_requested_depth(depth):
    p = build_prompt(_encode, 4096, depth, "48151")
    assert len(p.ids) == 4096 - ANSWER_TOKENS
    needle = _encode(NEEDLE.format(key="48151"))
    assert p.ids[p.needle_start: p.needle_start + len(needle)] == needle
    text = "".join(map(chr, p.ids))
    assert text.count("48151") == 2  # the needle says it twice, nothing else does
    sentence = len("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    haystack = p.filler_end - p.filler_start - p.needle_len
    assert abs(p.depth - depth) <= sentence / haystack  # at the nearest sentence boundary
    if depth == 0:
        assert p.needle_start == p.filler_start
    if depth == 1:
        assert p.needle_start + p.needle_len == p.filler_end
    with pytest.raises(BrrrError, match="--context 64 is too short for the passkey prompt"):
        build_prompt(_encode, 64, depth, "48151")


def test_eval_needle_fills_its_grid_with_rates(tmp_path, capsys):
    out = tmp_path / "needle.json"
    assert main(["eval", "needle", "--context", "128,256", "--depths", "0,50,100", "--trials", "2", "--device", "cpu",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert [(c["context"], c["depth"]) for c in result["grid"]] == [(L, d) for L in (128, 256) for d in (0, 50, 100)]
    for cell in result["grid"]:
        assert cell["trials"] == 2 and 0 <= cell["retrieved"] <= 2 and cell["rate"] == cell["retrieved"] / 2
        assert abs(cell["actual_depth"] - cell["depth"]) <= 35  # a 128-token prompt has a few filler sentences
    assert set(result["rate_by_context"]) == {"128", "256"}
    assert 0 <= result["rate"] <= 1
    assert main(["eval", "needle", "--context", "2k", "--device", "cpu"]) == 2
    assert "--context 2048 exceeds the model's context of 1024 tokens" in capsys.readouterr().err
    # YaRN x2 over the trained 1,024 tokens: the engine takes a 2k context
    yarn = '{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 1024}'
    assert main(["eval", "needle", "--context", "2k", "--depths", "50", "--trials", "1", "--device", "cpu",
                 "--rope-scaling", yarn]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rope"] == {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 1024}
    assert [(c["context"], c["trials"]) for c in result["grid"]] == [(2048, 1)] and 0 <= result["rate"] <= 1


def test_eval_ppl_context_cli_prints_one_row_per_length(capsys):
    assert main(["eval", "ppl", "--data", "stdlib", "--context", "128,256", "--max-windows", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["context"], r["windows"], r["tokens"]) for r in result["contexts"]] == [(128, 2, 254), (256, 2, 510)]
    assert result["rope"] == {"rope_type": "default"} and result["max_context"] == 1024


def test_engine_scores_equal_the_forward_and_show_the_cache(default, tokens):
    plain = context_perplexity(default.model, tokens, [256, 512])
    rows = engine_context_perplexity(brrr.LLM(None, dtype="float32", device="cpu"), tokens, [256, 512])
    assert [(r["context"], r["windows"], r["tokens"], r["kv_tokens"]) for r in rows] == \
        [(256, 4, 4 * 255, 256), (512, 2, 2 * 511, 512)]
    for a, b in zip(plain, rows):
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)
    fp8 = engine_context_perplexity(brrr.LLM(None, dtype="float32", device="cpu", kv_cache_dtype="fp8"), tokens,
                                    [256, 512])
    for a, b in zip(rows, fp8):  # e4m3 rounds every cached value: a real but small change
        assert b["nll"] != a["nll"] and b["nll"] == pytest.approx(a["nll"], rel=0.02)
        assert b["kv_bytes"] * 4 == a["kv_bytes"]
    streaming = engine_context_perplexity(brrr.LLM(None, dtype="float32", device="cpu", kv_eviction="streaming",
                                                   kv_budget=256), tokens, [256, 512])
    assert streaming[0]["nll"] == pytest.approx(rows[0]["nll"], rel=1e-5)  # the window fits the budget
    assert streaming[1]["nll"] != rows[1]["nll"] and streaming[1]["kv_tokens"] == 256
    assert streaming[1]["kv_bytes"] * 2 == rows[1]["kv_bytes"]


def test_eval_kv_flags_through_the_engine_and_their_refusals(capsys):
    assert main(["eval", "ppl", "--data", "stdlib", "--context", "256", "--max-windows", "1",
                 "--kv-cache-dtype", "fp8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kv_cache"] == {"kv_cache_dtype": "fp8"} and result["contexts"][0]["kv_tokens"] == 256
    assert main(["eval", "ppl", "--data", "stdlib", "--context", "1k", "--kv-cache-dtype", "fp8"]) == 2
    assert "a window is at most 1023 tokens" in capsys.readouterr().err
    assert main(["eval", "ppl", "--data", "stdlib", "--context", "512", "--kv-eviction", "snapkv",
                 "--kv-budget", "256"]) == 2
    assert "compacts a prompt once its prefill ends" in capsys.readouterr().err
    assert main(["eval", "ppl", "--data", "stdlib", "--kv-cache-dtype", "fp8"]) == 2
    assert "go with --context" in capsys.readouterr().err
    # needle under SnapKV (prefix caching turned off for it): the prompt compacted to 128 tokens, then answered
    assert main(["eval", "needle", "--context", "256", "--depths", "50", "--trials", "2", "--device", "cpu",
                 "--kv-eviction", "snapkv", "--kv-budget", "128"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kv_cache"] == {"kv_eviction": "snapkv", "kv_budget": 128, "enable_prefix_caching": False}
    assert 0 <= result["rate"] <= 1
