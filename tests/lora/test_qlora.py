"""QLoRA: the NF4 dequant kernel against its reference (Triton's interpreter on CPU), the NF4 base's matmul and its
backward, QLoRA's loss and adapter gradients against LoRA's on the NF4-dequantized base, and the layer-by-layer load."""
import pytest
import torch

from brrr.kernels import AttnMeta
from brrr.kernels.dispatch import triton_available
from brrr.quant.nf4_kernel import dequantize_nf4_ref, dequantize_nf4_triton
from brrr.loader import load_model
from brrr.lora import LoraConfig
from brrr.lora.layers import apply_lora, lora_modules
from brrr.lora.qlora import load_nf4_model, nf4_linear, nf4_quant_linear
from brrr.quant.formats import quantize_nf4
from brrr.quant.linear import QuantLinear, projections
from brrr.train.finetune import SFTLoss
from tests.hf_models import build, save


def _kernel_device():
    if not triton_available():
        pytest.skip("triton is not importable here")
    if torch.cuda.is_available():
        return "cuda"
    from brrr.quant.nf4_kernel import _nf4_dequant_kernel

    if type(_nf4_dequant_kernel).__name__ != "InterpretedFunction":
        pytest.skip("no GPU and triton is not in interpreter mode (TRITON_INTERPRET=1 before import)")
    return "cpu"


@pytest.mark.parametrize("shape", [(96, 64), (5, 320), (16, 1088)])  # 96 blocks; 25 blocks; 272 blocks (2 scale groups)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_kernel_matches_reference(shape, dtype):
    device = _kernel_device()
    torch.manual_seed(0)
    tensors = quantize_nf4(torch.randn(shape, device=device) * 0.03)
    got = dequantize_nf4_triton(tensors, shape, dtype)
    want = dequantize_nf4_ref(tensors, shape, dtype)
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)


def test_nf4_linear_forward_and_backward_use_the_dequantized_weight():
    torch.manual_seed(0)
    base = nf4_quant_linear(torch.randn(48, 64) * 0.1, torch.randn(48), torch.float32)
    dense = dequantize_nf4_ref(base.tensors(), (48, 64), torch.float32)
    x = torch.randn(7, 64, requires_grad=True)
    y = nf4_linear(x, base)
    torch.testing.assert_close(y, x @ dense.t() + base.bias)
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, (2 * y.detach()) @ dense)
    assert not base.qweight.requires_grad and base.bias.grad is None


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save(build("llama3-rope"), tmp_path_factory.mktemp("base"))


def _with_adapters(model):
    torch.manual_seed(4)
    mods = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "o_proj", "up_proj",
                                                                          "down_proj"), use_dora=True))
    with torch.no_grad():
        for m in mods.values():
            m.lora_B.normal_(0, 0.1)
    return mods


def test_qlora_equals_lora_on_the_dequantized_base(base_dir):
    qlora = load_nf4_model(base_dir, "cpu", torch.float32)
    lora = load_model(base_dir, dtype=torch.float32)
    with torch.no_grad():  # the LoRA run's base: the NF4 weights, dequantized
        for (name, linear), (qname, q) in zip(projections(lora), projections(qlora)):
            assert name == qname and isinstance(q, QuantLinear) and q.fmt == "nf4"
            linear.weight.copy_(dequantize_nf4_ref(q.tensors(), tuple(linear.weight.shape), torch.float32))
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(18), torch.arange(12)])
    batch = (ids, torch.roll(ids, -1), positions, AttnMeta.causal([18, 12], "cpu"))
    results = []
    for model in (qlora, lora):
        _with_adapters(model)
        loss = SFTLoss(model)(*batch)
        loss.backward()
        results.append((loss, lora_modules(model)))
    (q_loss, q_mods), (l_loss, l_mods) = results
    torch.testing.assert_close(q_loss, l_loss, rtol=1e-5, atol=1e-6)
    for name, m in q_mods.items():
        for attr in ("lora_A", "lora_B", "lora_magnitude"):
            torch.testing.assert_close(getattr(m, attr).grad, getattr(l_mods[name], attr).grad, rtol=1e-4, atol=1e-6)


def test_layer_by_layer_load_equals_quantizing_the_loaded_model(base_dir):
    qlora = load_nf4_model(base_dir, "cpu", torch.float32)
    full = load_model(base_dir, dtype=torch.float32)
    for (name, linear), (_, q) in zip(projections(full), projections(qlora)):
        want = quantize_nf4(linear.weight)
        for key in ("qweight", "absmax_q", "absmax_scales", "absmax_mean"):
            assert torch.equal(getattr(q, key), want[key]), (name, key)
    torch.testing.assert_close(qlora.model.embed_tokens.weight, full.model.embed_tokens.weight, rtol=0, atol=0)
    assert not any(p.requires_grad for p in qlora.parameters())
