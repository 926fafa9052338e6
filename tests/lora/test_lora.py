"""LoRA training modules against PEFT on transformers' model: same adapter weights (B non-zero) and batch -> same loss
and adapter gradients (fp32, rtol 1e-4 / atol 1e-6); adapters cross between brrr and PEFT with the same logits."""
import pytest
import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.lora import LoraConfig, load_adapter, save_adapter
from brrr.lora.layers import apply_lora, load_lora_state, lora_modules, lora_state
from brrr.train.finetune import SFTLoss
from tests.hf_models import build, save

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save(build("llama3-rope"), tmp_path_factory.mktemp("base"))


def _peft(dora=False, seed=1, targets=TARGETS, family="llama3-rope"):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, use_dora=dora)
    return peft.get_peft_model(build(family), config)


def _brrr_from(base_dir, adapter_dir):
    model = load_model(base_dir, dtype=torch.float32)
    load_lora_state(model, load_adapter(adapter_dir))
    return model


def _batch():
    """Two sequences of 16 tokens, the first 5 of each untrained: [2, 16] for transformers, flattened for brrr."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    flat = (ids.reshape(-1), targets.reshape(-1), torch.arange(16).repeat(2), AttnMeta.causal([16, 16], "cpu"))
    return ids, labels, flat


@pytest.mark.parametrize("family,dora", [("llama3-rope", False), ("llama3-rope", True), ("qwen2-bias", True)],
                         ids=["lora", "dora", "dora-qkv-bias"])
def test_loss_and_gradients_equal_peft(base_dir, tmp_path, family, dora):
    theirs = _peft(dora, family=family)
    theirs.save_pretrained(tmp_path / "adapter")
    if family != "llama3-rope":
        base_dir = save(build(family), tmp_path / "base")
    mine = _brrr_from(base_dir, tmp_path / "adapter")
    ids, labels, flat = _batch()
    their_loss = theirs(input_ids=ids, labels=labels).loss
    their_loss.backward()
    my_loss = SFTLoss(mine)(*flat)
    my_loss.backward()
    torch.testing.assert_close(my_loss, their_loss, **TOL)
    mods = lora_modules(mine)
    assert len(mods) == 2 * len(TARGETS)
    for name, m in mods.items():
        layer = theirs.base_model.model.get_submodule(name)
        torch.testing.assert_close(m.lora_A.grad, layer.lora_A["default"].weight.grad, **TOL)
        torch.testing.assert_close(m.lora_B.grad, layer.lora_B["default"].weight.grad, **TOL)
        if dora:
            torch.testing.assert_close(m.lora_magnitude.grad, layer.lora_magnitude_vector["default"].weight.grad,
                                       **TOL)


def test_init_is_peft_and_only_adapters_train(base_dir):
    model = load_model(base_dir, dtype=torch.float32)
    mods = apply_lora(model, LoraConfig(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")))
    assert sorted(mods) == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in mods for x in "AB"}
    m = mods["model.layers.0.self_attn.q_proj"]
    assert (m.lora_B == 0).all() and m.lora_A.abs().max() <= 1 / 64 ** 0.5  # kaiming_uniform(a=sqrt 5): 1/sqrt(in)
    x = torch.randn(3, 64)
    torch.testing.assert_close(m(x), m.base(x))  # B = 0: the adapter starts as the base


def test_brrr_adapter_loads_in_peft_with_the_same_logits(base_dir, tmp_path):
    model = load_model(base_dir, dtype=torch.float32)
    torch.manual_seed(2)
    mods = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=tuple(TARGETS), use_dora=True))
    with torch.no_grad():  # a trained adapter: B and the magnitudes moved
        for m in mods.values():
            m.lora_B.normal_(0, 0.05)
            m.lora_magnitude.mul_(1 + 0.1 * torch.randn_like(m.lora_magnitude))
    save_adapter(tmp_path, lora_state(model, base_model_name_or_path=str(base_dir)))
    theirs = peft.PeftModel.from_pretrained(build("llama3-rope"), tmp_path).eval()
    ids, _, flat = _batch()
    mine = model.compute_logits(model(flat[0], flat[2], flat[3])).view(2, 16, -1)
    with torch.no_grad():
        torch.testing.assert_close(mine.detach(), theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_peft_adapter_gives_peft_greedy_tokens_in_brrr(base_dir, tmp_path):
    theirs = _peft(targets=["q_proj", "v_proj", "down_proj"]).eval()
    theirs.save_pretrained(tmp_path)
    mine = _brrr_from(base_dir, tmp_path)
    prompt = [5, 17, 42, 9]
    with torch.no_grad():
        want = theirs.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        ids = list(prompt)
        for _ in range(8):
            n = len(ids)
            logits = mine.compute_logits(mine(torch.tensor(ids), torch.arange(n), AttnMeta.causal([n], "cpu")))
            ids.append(int(logits[-1].argmax()))
    assert ids == want


def test_bad_input(base_dir, tmp_path):
    with pytest.raises(BrrrError, match="r must be a positive integer"):
        LoraConfig(r=0, lora_alpha=8, target_modules=("q_proj",))
    model = load_model(base_dir, dtype=torch.float32)
    with pytest.raises(BrrrError, match="'q_prj' matches no module"):
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "q_prj")))
    _peft().save_pretrained(tmp_path)
    other = load_model(save(build("llama3-rope", hidden_size=96), tmp_path / "wider"), dtype=torch.float32)
    with pytest.raises(BrrrError, match="another base model"):
        load_lora_state(other, load_adapter(tmp_path))
