"""`brrr finetune`: a short LoRA fine-tune of the shipped model lowers the held-out loss of a small chat set; the
output is a PEFT adapter naming its base; --resume continues bit for bit; bad flags fail with clear errors."""
import json

import pytest
import torch

from brrr.cli import main
from brrr.errors import BrrrError
from brrr.lora import load_adapter
from brrr.train.finetune import FinetuneConfig
from brrr.train.trainer import Trainer
from tests.hf_models import build, save, save_tokenizer

COLORS = {"apple": "red", "sky": "blue", "grass": "green", "banana": "yellow", "plum": "purple", "orange": "orange",
          "coal": "black", "snow": "white"}


def write_chat(path, n=96):
    lines = []
    for i in range(n):
        thing = list(COLORS)[i % len(COLORS)]
        if i % 4 == 3:
            lines.append({"prompt": f"def {thing}_color():\n    return", "completion": f' "{COLORS[thing]}"\n'})
        else:
            lines.append({"messages": [{"role": "user", "content": f"What color is the {thing}? ({i % 7})"},
                                       {"role": "assistant", "content": f"The {thing} is {COLORS[thing]}."}]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _cfg(data, out, **kw):
    base = dict(seq_len=128, micro_batch=2, grad_accum=1, max_steps=12, lr=2e-3, warmup_steps=2, eval_every=6,
                log_every=6, checkpoint_every=6, lora_r=8, lora_dropout=0.0)
    return FinetuneConfig(kw.pop("model", None), str(data), str(out), **{**base, **kw})


def test_short_finetune_of_the_shipped_model_lowers_held_out_loss(tmp_path, capsys):
    tuner = Trainer(_cfg(write_chat(tmp_path / "chat.jsonl"), tmp_path / "out"))
    before = tuner.evaluate(None)["val_loss"]
    summary = tuner.run()
    assert summary["val_loss"] < 0.5 * before, (before, summary["val_loss"])
    # the summary names the model it tuned (the shipped default's directory), not null
    assert json.loads((tmp_path / "out" / "train_summary.json").read_text())["model"].endswith("default-model")
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith(("eval @", "final eval @"))] and \
        not [line for line in lines if line.rstrip().endswith("|")], lines  # no empty last field
    adapter = load_adapter(tmp_path / "out")
    assert adapter.config.r == 8 and adapter.config.base_model_name_or_path.endswith("default-model")
    assert len(adapter.weights) == 6 * 7  # every projection of the 6 layers
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [6, 12] and all("tokens_per_s" in r for r in log if "loss" in r)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = save(build("llama3-rope", vocab_size=320), tmp_path_factory.mktemp("tiny"))
    return save_tokenizer(path)


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_resume_continues_bit_for_bit(tmp_path, tiny_dir, qlora):
    data = write_chat(tmp_path / "chat.jsonl", 48)
    kw = dict(model=str(tiny_dir), max_steps=6, eval_every=3, checkpoint_every=3, lora_dropout=0.1, qlora=qlora)
    Trainer(_cfg(data, tmp_path / "straight", **kw)).run()
    Trainer(_cfg(data, tmp_path / "halted", stop_at=3, **kw)).run()
    Trainer(_cfg(data, tmp_path / "halted", resume=True, **kw)).run()
    a, b = load_adapter(tmp_path / "straight"), load_adapter(tmp_path / "halted")
    for name, (x, y) in a.weights.items():
        assert torch.equal(x, b.weights[name][0]) and torch.equal(y, b.weights[name][1]), name


def test_cli_writes_a_peft_adapter_and_refuses_bad_flags(tmp_path, tiny_dir, capsys):
    data = write_chat(tmp_path / "chat.jsonl", 24)
    out = tmp_path / "adapter"
    argv = ["finetune", "--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--seq-len", "96",
            "--max-steps", "2", "--lora-r", "4", "--target-modules", "q_proj,v_proj", "--use-dora"]
    assert main(argv) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_dora"] and config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(tiny_dir.resolve())
    assert main(argv) == 2 and "pass --resume" in capsys.readouterr().err
    assert main([*argv[:6], str(tmp_path / "more"), "--adapter", str(out), "--max-steps", "1"]) == 0  # continue it
    assert load_adapter(tmp_path / "more").config.use_dora and load_adapter(tmp_path / "more").config.r == 4
    for flags, message in ((["--lora-r", "0"], "r must be a positive integer"),
                           (["--target-modules", "q_proj,qkv_proj"], "'qkv_proj' matches no module"),
                           (["--seq-len", "4096"], "exceeds the model's context")):
        assert main([*argv[:6], str(tmp_path / "new"), *argv[7:], *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(BrrrError, match="line 2"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
        Trainer(_cfg(tmp_path / "bad.jsonl", tmp_path / "bad", model=str(tiny_dir)))


def test_calc_train_lora_and_qlora(capsys):
    """PEFT reports 41,943,040 trainable parameters for Llama-3-8B with r=16 on all seven projections."""
    argv = ["calc", "train", "llama-3.1-8b", "--lora-r", "16", "--checkpointing", "--seq-len", "2048", "--json"]
    assert main(argv) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main([*argv, "--qlora"]) == 0
    qlora = json.loads(capsys.readouterr().out)
    assert lora["memory"]["adapter_params"] == qlora["memory"]["adapter_params"] == 41_943_040
    assert lora["memory"]["optimizer"] == 8 * 41_943_040
    # bf16 projections: 2 bytes; NF4 + double quant: 0.5 + 1/64 + 4/16384
    assert qlora["memory"]["base_bytes_per_projection_param"] == pytest.approx(0.51587, abs=1e-5)
    assert 15e9 < lora["memory"]["base_weights"] < 16.5e9 and 5e9 < qlora["memory"]["base_weights"] < 6e9
    assert qlora["memory"]["total"] < 10e9 < lora["memory"]["total"]
    assert main(["calc", "train", "llama-3.1-8b", "--lora-r", "0"]) == 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_modes_give_the_same_gradients(tiny_dir, mode):
    """Recomputing (all of a layer, or all but its matmuls and attention) changes no gradient, dropout included."""
    from brrr.kernels import AttnMeta
    from brrr.loader import load_model
    from brrr.lora import LoraConfig
    from brrr.lora.layers import apply_lora
    from brrr.train.finetune import SFTLoss
    from brrr.train.trainer import checkpoint_activations

    grads = []
    for checkpointing in ("none", mode):
        model = load_model(tiny_dir, dtype=torch.float32)
        torch.manual_seed(0)
        mods = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "gate_proj",
                                                                               "down_proj"), lora_dropout=0.1))
        with torch.no_grad():
            for m in mods.values():
                m.lora_B.normal_(0, 0.1)
        model.train()
        if checkpointing != "none":
            checkpoint_activations(model, selective=checkpointing == "selective")
        ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(5)
        loss = SFTLoss(model, recompute_logits=checkpointing == "full")(
            ids, torch.roll(ids, -1), torch.cat([torch.arange(25), torch.arange(15)]), AttnMeta.causal([25, 15], "cpu"))
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for m in mods.values() for p in (m.lora_A, m.lora_B)]))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_bench_finetune_runs_each_variant(tiny_dir):
    """`brrr bench finetune`'s variants on a tiny model on the CPU (its numbers only mean something on a GPU)."""
    import argparse

    from brrr.bench.finetune import run_variant

    args = argparse.Namespace(model=str(tiny_dir), seq_len=32, r=4, alpha=8.0, dropout=0.05, steps=1, warmup=1)
    trainable = set()
    for variant in ("brrr-lora", "brrr-lora-selective", "brrr-qlora", "peft-lora"):
        record = run_variant(variant, args)
        assert record["tokens_per_s"] > 0 and record["final_loss"] > 0, variant
        assert record["predicted"]["checkpointing"] == ("selective" if variant.endswith("selective") else "full")
        trainable.add(record["trainable_params"])
    assert trainable == {record["predicted"]["adapter_params"]}  # brrr and PEFT train the same adapter


def test_bench_finetune_runs_a_variant_in_its_own_process(tiny_dir, tmp_path, capsys):
    """The command line: each variant in a child `brrr bench finetune --variant` process, its record appended."""
    out = tmp_path / "ft.jsonl"
    assert main(["bench", "finetune", "--model", str(tiny_dir), "--seq-len", "16", "--r", "4", "--steps", "1",
                 "--warmup", "1", "--variants", "brrr-lora", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["bench"] == "finetune_speed" and record["variant"] == "brrr-lora" and record["tokens_per_s"] > 0
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == record
    assert main(["bench", "finetune", "--timeout", "nan"]) == 2
    assert "--timeout must be >= 1, got nan" in capsys.readouterr().err


def test_a_brrr_quantized_nf4_checkpoint_is_a_qlora_base(tmp_path, tiny_dir):
    assert main(["quantize", "--model", str(tiny_dir), "--method", "nf4", "--out", str(tmp_path / "nf4")]) == 0
    data = tmp_path / "pairs.jsonl"  # prompt/completion: this output directory carries no chat template
    data.write_text("".join(json.dumps({"prompt": f"x{i} =", "completion": f" {i}"}) + "\n" for i in range(24)))
    tuner = Trainer(_cfg(data, tmp_path / "out", model=str(tmp_path / "nf4"), max_steps=1))
    assert all(m.base.fmt == "nf4" for m in tuner.model.modules() if hasattr(m, "lora_A"))
    tuner.run()
    assert main(["quantize", "--model", str(tiny_dir), "--method", "rtn-int8", "--out", str(tmp_path / "int8")]) == 0
    with pytest.raises(BrrrError, match="int8 weights"):
        Trainer(_cfg(data, tmp_path / "out8", model=str(tmp_path / "int8")))
