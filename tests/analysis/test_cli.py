"""`brrr calc` through its own argparse registration (brrr/cli.py wires the same `register`), and bad input."""
import argparse
import json
import re

import pytest
import torch

from brrr.analysis.cli import load_model, register
from brrr.analysis.formats import kv_bytes, weight_format
from brrr.analysis.hardware import GPUS, get_gpu, measure
from brrr.analysis.model import param_counts
from brrr.analysis.serve import serve_plan
from brrr.analysis.train import pipeline_bubble, train_plan
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.presets import PRESETS, preset_config


def calc(argv, capsys):
    parser = argparse.ArgumentParser(prog="brrr")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calc", *argv])
    code = args.func(args)
    out = capsys.readouterr().out
    return code, (json.loads(out) if "--json" in argv else out)


def test_model_json(capsys):
    code, out = calc(["model", "llama-3.1-8b", "--json", "--batch", "1,64", "--context", "4096"], capsys)
    assert code == 0
    assert out["params"]["total"] == 8_030_261_248
    assert out["kv"]["attention"].startswith("GQA") and out["kv"]["bytes_per_token"]["bf16"] == 131_072
    assert out["weight_bytes"]["bf16"] == 16_060_522_496
    assert [d["batch"] for d in out["decode"]] == [1, 64]
    assert out["compute_bound_batch"] is None  # at 4,096 tokens (see test_worked)


def test_model_table_for_moe_and_mla(capsys):
    code, out = calc(["model", "mixtral-8x7b", "--context", "1024"], capsys)
    assert code == 0 and "active per token (2 of 8 experts)" in out and "12.88 G" in out
    code, out = calc(["model", "deepseek-v3", "--kv", "fp8", "--weights", "int4"], capsys)
    assert code == 0 and "KV cache: MLA" in out and "70.27 kB" in out


def test_model_from_hf_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"]))
    code, out = calc(["model", str(tmp_path), "--json"], capsys)
    assert out["params"]["total"] == 596_049_920 and out["tied_embeddings"] is True


def test_serve_json_and_table(capsys):
    code, out = calc(["serve", "llama-3.1-8b", "--gpu", "h200", "--batch", "1,64", "--json"], capsys)
    assert code == 0 and out["max_sequences"] == 204
    assert out["decode"][0]["tok_s_per_seq"] == pytest.approx(4.8e12 / (15_009_857_536 + 537_001_984))
    code, out = calc(["serve", "llama-2-70b", "--gpu", "h100", "--tp", "4", "--weights", "int4", "--kv", "fp8"], capsys)
    assert code == 0 and "TTFT for a 1024-token prompt" in out


def test_serve_says_when_the_model_does_not_fit(capsys):
    code, out = calc(["serve", "llama-2-70b", "--gpu", "rtx-4090", "--batch", "1", "--json"], capsys)
    assert code == 0 and out["fits"] is False and out["max_sequences"] == 0 and out["kv_memory_per_gpu"] == 0
    code, out = calc(["serve", "llama-2-70b", "--gpu", "rtx-4090", "--batch", "1"], capsys)
    assert "does not fit" in out


def test_train_json_and_table(capsys):
    code, out = calc(["train", "llama-2-13b", "--gpus", "8", "--zero", "3", "--gpu", "a100", "--json"], capsys)
    # calc counts what PyTorch holds: Adam's fp32 m and v (8 bytes per parameter) sharded 8 ways
    assert code == 0 and out["memory"]["optimizer"] == 13_015_864_320 * 8 / 8
    code, out = calc(["train", "llama-3.1-8b", "--gpus", "8", "--tp", "2", "--pp", "4", "--checkpointing",
                      "--schedule", "interleaved", "--chunks", "2", "--microbatches", "16"], capsys)
    # interleaved, v = 2: (4 - 1) / (2 x 16 + 4 - 1) = 3/35 = 8.6% of the step; overhead 3/32 = 9.4%
    assert code == 0 and "8.6% of the step (9.4% overhead)" in out


def test_train_assumes_a_typical_efficiency_and_says_so(capsys):
    """Not the roofline's 100%: 40% of the bf16 peak unless --efficiency says otherwise, printed with the result."""
    code, out = calc(["train", "llama-3.1-8b", "--gpu", "h100", "--zero", "3", "--json"], capsys)
    assert code == 0 and out["efficiency"] == 0.4 and out["mfu"] == pytest.approx(0.4)
    code, out = calc(["train", "llama-3.1-8b", "--gpu", "h100", "--zero", "3"], capsys)
    assert "assumed matmul efficiency (--efficiency)" in out and "40% of the bf16 peak" in out
    assert re.search(r"MFU\s+\S*\s*40\.0%", out), out
    code, out = calc(["train", "llama-3.1-8b", "--gpu", "h100", "--zero", "3", "--efficiency", "1", "--json"], capsys)
    assert out["mfu"] == pytest.approx(1.0)


def test_roofline_json_and_plot(tmp_path, capsys):
    code, out = calc(["roofline", "--gpu", "a100", "--json"], capsys)
    assert code == 0 and out["ridge"] == pytest.approx(312 / 2.039)
    names = [op["name"] for op in out["ops"]]
    assert "RMSNorm 4096x4096" in names and "softmax 4096x4096" in names
    pytest.importorskip("matplotlib")
    png = tmp_path / "roofline.png"
    code, out = calc(["roofline", "--gpu", "h200", "--plot", str(png)], capsys)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_roofline_table_piped_keeps_one_line_a_row(capsys, monkeypatch):
    """capsys is not a terminal, as a pipe is not: rich's 80 columns used to wrap and cut the op names."""
    monkeypatch.delenv("COLUMNS", raising=False)
    _, ops = calc(["roofline", "--json"], capsys)
    code, out = calc(["roofline"], capsys)
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert code == 0 and "…" not in out and len(rows) == len(ops["ops"]), out
    assert all(f"│ {op['name']} " in row for op, row in zip(ops["ops"], rows)), out


# ---- bad input: each error names the field or lists what is known ----

def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(BrrrError) as e:
        get_gpu("h300")
    assert "h300" in str(e.value) and all(name in str(e.value) for name in GPUS)
    assert get_gpu("H100") is GPUS["h100-sxm"] and get_gpu("A100") is GPUS["a100-80gb"]


def test_unknown_model_lists_presets(capsys):
    with pytest.raises(BrrrError, match="llama-3.1-8b"):
        load_model("llama-9")
    with pytest.raises(BrrrError, match="unknown preset 'gpt-5'.*mixtral-8x7b"):
        preset_config("gpt-5")


def test_config_without_needed_fields_names_them():
    raw = dict(PRESETS["llama-3.1-8b"])
    del raw["num_hidden_layers"]
    with pytest.raises(BrrrError, match="'num_hidden_layers' is missing"):
        ModelConfig.from_hf(raw)
    moe = {k: v for k, v in PRESETS["mixtral-8x7b"].items() if k != "num_experts_per_tok"}
    with pytest.raises(BrrrError, match="no num_experts_per_tok"):
        param_counts(ModelConfig.from_hf(moe))
    qwen_moe = {**PRESETS["qwen3-8b"], "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                "num_experts_per_tok": 2}
    with pytest.raises(BrrrError, match="no moe_intermediate_size"):
        param_counts(ModelConfig.from_hf(qwen_moe))
    mla = {k: v for k, v in PRESETS["deepseek-v3"].items() if k != "v_head_dim"}
    with pytest.raises(BrrrError, match="no v_head_dim"):
        param_counts(ModelConfig.from_hf(mla))


def test_bad_options_name_the_limit():
    cfg, h200 = preset_config("llama-3.1-8b"), get_gpu("h200")
    with pytest.raises(BrrrError, match="--tp 3 must be >= 1 and divide num_attention_heads \\(32\\)"):
        serve_plan(cfg, h200, tp=3)
    with pytest.raises(BrrrError, match="--util must be in \\(0, 1\\]"):
        serve_plan(cfg, h200, util=1.5)
    with pytest.raises(BrrrError, match="unknown weight format 'int3'; known: fp32, bf16"):
        weight_format("int3")
    with pytest.raises(BrrrError, match="unknown KV-cache dtype 'int4'"):
        kv_bytes("int4")
    with pytest.raises(BrrrError, match="--gpus \\(6\\) must be a positive multiple of --tp x --pp \\(2 x 2\\)"):
        train_plan(cfg, h200, gpus=6, tp=2, pp=2)
    with pytest.raises(BrrrError, match="--zero must be 0, 1, 2 or 3"):
        train_plan(cfg, h200, zero=4)
    with pytest.raises(BrrrError, match="--schedule must be one of gpipe, 1f1b, interleaved"):
        pipeline_bubble(4, 16, "zb-v")
    with pytest.raises(BrrrError, match="needs --microbatches \\(6\\) to be a multiple of --pp \\(4\\)"):
        train_plan(cfg, h200, gpus=8, pp=4, microbatches=6, schedule="interleaved", chunks=2)
    with pytest.raises(BrrrError, match="A100 SXM 80GB has no fp8 peak"):
        get_gpu("a100").peak("fp8")
    with pytest.raises(BrrrError, match=r"--context \(0\), --prompt \(1024\) and block size \(16\) must be >= 1"):
        serve_plan(cfg, h200, context=0)


def test_cli_rejects_bad_batch_list(capsys):
    parser = argparse.ArgumentParser(prog="brrr")
    register(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit):
        parser.parse_args(["calc", "model", "llama-3.1-8b", "--batch", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_measure_without_a_gpu_says_so():
    with pytest.raises(BrrrError, match="--measure needs a CUDA GPU"):
        measure()
