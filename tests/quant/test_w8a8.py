"""W8A8: SmoothQuant's folding and its effect on per-token int8 error, the int8 (`torch._int_mm`) and FP8 (the
dequantized reference of `torch._scaled_mm`) linears, and the W8A8 default model's perplexity."""
import sysconfig
from pathlib import Path

import pytest
import torch

import brrr
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.quant import quantize_per_token_ref
from brrr.loader import load_model
from brrr.quant import formats
from brrr.quant.evaluate import perplexity
from brrr.quant.methods import quantize_model
from brrr.quant.smoothquant import smooth_model, smooth_scales
from brrr.quant.w8a8 import _int_mm, fp8_w8a8_linear, int8_w8a8_linear, int_mm_ref


def _logits(model, ids):
    return model.compute_logits(model(ids.flatten(), torch.arange(ids.shape[1]).repeat(len(ids)),
                                      AttnMeta.causal([ids.shape[1]] * len(ids), "cpu")))


@torch.no_grad()
def test_smoothquant_folded_scales_leave_the_float_model_unchanged(tiny_dir, calib):
    model = load_model(tiny_dir, dtype=torch.float32)
    before = _logits(model, calib)
    norm = model.model.layers[0].post_attention_layernorm.weight.clone()
    up = model.model.layers[1].mlp.up_proj.weight.clone()
    smooth_model(model, calib)
    assert not torch.equal(norm, model.model.layers[0].post_attention_layernorm.weight)
    assert not torch.equal(up, model.model.layers[1].mlp.up_proj.weight)  # rows (for down_proj) and columns
    torch.testing.assert_close(_logits(model, calib), before, rtol=1e-5, atol=1e-5)


def _w8a8_error(x, w):
    """Relative output error of per-token int8 x per-channel int8 (both dequantized), vs the float product."""
    xq, sx = quantize_per_token_ref(x, torch.int8)
    t = formats.quantize_int8(w)
    y = (xq.float() * sx) @ formats.dequantize_int8(t).T
    return ((y - x @ w.T).norm() / (x @ w.T).norm()).item()


def test_smoothing_lowers_w8a8_error_when_a_few_channels_carry_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g)
    x[:, :4] *= 60  # outlier channels, as LLM activations have
    w = torch.randn(128, 256, generator=g) * 0.05
    s = smooth_scales(x.abs().amax(0), [w])
    plain, smoothed = _w8a8_error(x, w), _w8a8_error(x / s, w * s)
    assert smoothed < 0.5 * plain, (smoothed, plain)


def test_int8_w8a8_linear_is_the_exact_integer_product_rescaled():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    t = formats.quantize_int8(w)
    xq, sx = quantize_per_token_ref(x, torch.int8)
    exact = int_mm_ref(xq, t["qweight"].t())
    assert exact.dtype == torch.int32 and torch.equal(_int_mm(xq, t["qweight"].t()), exact)  # torch._int_mm on CPU
    want = (exact.double() * sx.double() * t["scales"].double() + bias.double()).float()
    torch.testing.assert_close(int8_w8a8_linear(x, t["qweight"], t["scales"], bias), want)


def test_fp8_w8a8_reference_multiplies_the_dequantized_codes():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 2, 64, generator=g), torch.randn(32, 64, generator=g)
    t = formats.quantize_fp8(w)
    xq, sx = quantize_per_token_ref(x.reshape(6, 64), torch.float8_e4m3fn)
    want = (xq.float() * sx) @ formats.dequantize_fp8(t).T
    got = fp8_w8a8_linear(x, t["qweight"], t["scales"])
    assert got.shape == (3, 2, 32)
    torch.testing.assert_close(got.reshape(6, 32), want)


def test_w8a8_config_must_match_its_format(tiny_dir, calib, tmp_path):
    import json

    from brrr.quant.checkpoint import save_quantized

    model = load_model(tiny_dir, dtype=torch.float32)
    save_quantized(model, quantize_model(model, "smoothquant", calib=calib), tmp_path, tiny_dir)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["activations"] == "int8"
    cfg["quantization_config"]["activations"] = "fp8"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BrrrError, match="activations 'fp8' needs format 'fp8'"):
        load_model(tmp_path)


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_w8a8_default_model_perplexity_within_one_percent_of_float():
    """SmoothQuant (alpha 0.5) and FP8 W8A8 on the shipped model, 2,048 tokens of stdlib source it never saw as
    calibration (calibration: argparse.py). docs/quantization.md has the full-size table."""
    pre = brrr.load(device="cpu", dtype="float32")
    encode = lambda name: torch.tensor(pre.tokenizer.encode((STDLIB / name).read_text(),  # noqa: E731
                                                            add_special_tokens=False))
    calib, tokens = encode("argparse.py")[: 8 * 256].view(8, 256), encode("textwrap.py")[:2048]
    base = perplexity(pre.model, tokens)["ppl"]
    for method in ("smoothquant", "fp8-w8a8"):
        model = brrr.load(device="cpu", dtype="float32").model
        quantize_model(model, method, calib=calib)
        ppl = perplexity(model, tokens)["ppl"]
        assert ppl < 1.01 * base, (method, ppl, base)
