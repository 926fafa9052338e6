"""LoRA / QLoRA training on CUDA: the NF4 dequant kernel against its reference, the NF4 matmul's gradient, a bf16
LoRA step against the fp32 CPU one, the QLoRA build's peak memory (no full-precision copy) and `brrr finetune`."""
import json
import subprocess
import sys

import pytest
import torch

from brrr.kernels import AttnMeta
from brrr.quant.nf4_kernel import dequantize_nf4_ref, dequantize_nf4_triton
from brrr.lora import LoraConfig
from brrr.lora.layers import apply_lora, lora_modules
from brrr.lora.qlora import nf4_linear, nf4_quant_linear, random_nf4_model
from brrr.presets import preset_config
from brrr.quant.formats import quantize_nf4
from brrr.train.finetune import SFTLoss
from tests.hf_models import build, save

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (1024, 4160), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_dequant_kernel_matches_reference(shape, dtype):
    torch.manual_seed(0)
    tensors = quantize_nf4(torch.randn(shape, device="cuda") * 0.02)
    got = dequantize_nf4_triton(tensors, shape, dtype)
    want = dequantize_nf4_ref(tensors, shape, dtype)
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)


def test_nf4_linear_gradient_is_the_dequantized_weights():
    torch.manual_seed(0)
    w = torch.randn(512, 256, device="cuda") * 0.05
    base = nf4_quant_linear(w, None, torch.bfloat16)
    dense = dequantize_nf4_ref(base.tensors(), (512, 256), torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = nf4_linear(x, base)
    y.float().square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (x2 @ dense.t()).float().square().sum().backward()
    torch.testing.assert_close(y, x.detach() @ dense.t())
    torch.testing.assert_close(x.grad, x2.grad)


def _loss_and_grads(model, device, autocast):
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (40,))
    batch = (ids.to(device), torch.roll(ids, -1).to(device), torch.cat([torch.arange(25), torch.arange(15)]).to(device),
             AttnMeta.causal([25, 15], device))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = SFTLoss(model)(*batch)
    loss.backward()
    return loss.item(), {n: m.lora_B.grad.float().cpu() for n, m in lora_modules(model).items()}


def test_bf16_lora_step_matches_fp32_cpu(tmp_path):
    from brrr.loader import load_model

    save(build("llama3-rope"), tmp_path)
    results = []
    for device, dtype, autocast in (("cpu", torch.float32, False), ("cuda", torch.bfloat16, True)):
        model = load_model(tmp_path, dtype=dtype, device=device)
        mods = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))
        gen = torch.Generator().manual_seed(1)  # the same adapter weights on both devices: drawn on the CPU
        with torch.no_grad():
            for m in mods.values():
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=gen) * 0.1)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.1)
        results.append(_loss_and_grads(model, device, autocast))
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert abs(cpu_loss - gpu_loss) < 0.05 * abs(cpu_loss)
    for name, g in cpu_grads.items():
        assert torch.isfinite(gpu_grads[name]).all()
        assert torch.nn.functional.cosine_similarity(g.flatten(), gpu_grads[name].flatten(), dim=0) > 0.95, name


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_selective_checkpointing_keeps_cuda_attention_and_matmuls_exact(tmp_path, qlora):
    """On CUDA the policy keeps SDPA's and the wide matmuls' outputs (on the CPU it recomputes attention): the
    gradients must still be those of a run without checkpointing."""
    from brrr.loader import load_model
    from brrr.lora.qlora import load_nf4_model
    from brrr.train.trainer import checkpoint_activations

    save(build("llama3-rope"), tmp_path)
    grads = []
    for mode in ("none", "selective"):
        model = (load_nf4_model(tmp_path, "cuda", torch.bfloat16) if qlora
                 else load_model(tmp_path, dtype=torch.bfloat16, device="cuda"))
        mods = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "o_proj", "down_proj"),
                                            lora_dropout=0.1))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in mods.values():
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=gen) * 0.1)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.1)
        model.train()
        if mode == "selective":
            checkpoint_activations(model, selective=True)
        torch.manual_seed(7)
        _, g = _loss_and_grads(model, "cuda", True)
        grads.append(g)
    for name, g in grads[0].items():  # attention's backward may sum in another order run to run
        torch.testing.assert_close(grads[1][name], g, rtol=1e-2, atol=1e-5)


def test_qlora_build_never_holds_the_full_precision_model():
    cfg = preset_config("llama-3.2-1b")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = random_nf4_model(cfg, torch.device("cuda"), torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - before
    bf16_bytes = 2 * sum(p.numel() for p in model.parameters()) + 2 * sum(
        m.in_features * m.out_features for n, m in model.named_modules() if hasattr(m, "fmt"))
    assert peak < 0.6 * bf16_bytes, (peak, bf16_bytes)
    del model


def test_finetune_cli_on_cuda(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"}]}
            for w in ("red", "blue", "green", "gold", "teal", "pink", "gray", "navy") * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for qlora in ([], ["--qlora"]):
        out = tmp_path / f"out{len(qlora)}"
        cmd = [sys.executable, "-m", "brrr", "finetune", "--data", str(data), "--out", str(out), "--seq-len", "128",
               "--max-steps", "6", "--eval-every", "3", "--log-every", "3", "--lora-r", "4", *qlora]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert (out / "adapter_model.safetensors").is_file()
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        assert any(r.get("peak_memory_gb") for r in log)
