"""PEFT's adapter format: what PEFT writes brrr reads, and what brrr writes PEFT reads, tensor for tensor."""
import json

import pytest
import torch

from brrr.errors import BrrrError
from brrr.lora import LoraAdapter, LoraConfig, check_against, load_adapter, save_adapter, target_names
from tests.hf_models import build

peft = pytest.importorskip("peft")


def _peft_model(**kw):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                             **kw)
    torch.manual_seed(1)
    return peft.get_peft_model(build("llama3-rope"), config)


@pytest.mark.parametrize("dora", [False, True])
def test_reads_what_peft_writes(tmp_path, dora):
    model = _peft_model(use_dora=dora)
    model.save_pretrained(tmp_path)
    adapter = load_adapter(tmp_path)
    assert adapter.config.r == 4 and adapter.config.scaling == 2.0 and adapter.config.use_dora == dora
    names = {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert set(adapter.weights) == names
    assert set(adapter.magnitudes) == (names if dora else set())
    lora = model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = adapter.weights["model.layers.1.self_attn.q_proj"]
    torch.testing.assert_close(a, lora.lora_A["default"].weight, rtol=0, atol=0)
    torch.testing.assert_close(b, lora.lora_B["default"].weight, rtol=0, atol=0)
    base = model.base_model.model
    check_against(adapter, base)
    assert target_names([n for n, _ in base.named_modules()], adapter.config.target_modules) == sorted(
        names, key=[n for n, _ in base.named_modules()].index)


def test_peft_reads_what_brrr_writes(tmp_path):
    model = _peft_model()
    model.save_pretrained(tmp_path / "peft")
    adapter = load_adapter(tmp_path / "peft")
    save_adapter(tmp_path / "brrr", adapter)
    again = peft.PeftModel.from_pretrained(build("llama3-rope"), tmp_path / "brrr")
    x = torch.randint(0, 256, (1, 12))
    torch.testing.assert_close(again(x).logits, model(x).logits)
    assert json.loads((tmp_path / "brrr" / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_bad_adapters(tmp_path):
    with pytest.raises(BrrrError, match="no adapter_config.json"):
        load_adapter(tmp_path)
    model = _peft_model()
    model.save_pretrained(tmp_path)
    adapter = load_adapter(tmp_path)
    other = build("llama3-rope", hidden_size=96)
    with pytest.raises(BrrrError, match="another base model"):
        check_against(adapter, other)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"q_proj": 8}}))
    with pytest.raises(BrrrError, match="rank_pattern"):
        load_adapter(tmp_path)
    with pytest.raises(BrrrError, match="r must be a positive"):
        LoraConfig(r=0, lora_alpha=8, target_modules=("q_proj",))


def test_delta_is_scaled_product():
    a, b = torch.randn(2, 5), torch.randn(3, 2)
    adapter = LoraAdapter(LoraConfig(r=2, lora_alpha=6, target_modules=("x",)), {"x": (a, b)})
    torch.testing.assert_close(adapter.delta("x"), 3.0 * b @ a)
