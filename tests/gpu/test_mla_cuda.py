"""MLA's absorbed decode on the GPU's fast path (brrr/kernels/mla_decode.py through `mla_decode`): a tiny DeepSeek-V3
whose latent (32) and rotary key (16) widths the Triton kernel takes, served by the engine with and without CUDA
graphs, chunked prefill beside decodes; greedy tokens held to transformers' by test_fast_path_parity's rule."""
import random

import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.kernels.mla_attention import mla_decode, mla_decode_ref
from brrr.kernels.mla_decode import mla_decode_ok
from tests import hf_models
from tests.gpu.test_fast_path_parity import engine_greedy, first_divergence_gap, hf_greedy_cuda

pytestmark = pytest.mark.gpu

WIDE = dict(kv_lora_rank=32, qk_rope_head_dim=16, max_position_embeddings=512)


def test_serving_decode_takes_the_kernel_and_equals_the_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    h, nope, rope, v, r, bs = 16, 128, 64, 128, 512, 16
    cache = torch.randn(300, bs, 1, r + rope, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(300, device="cuda", generator=g)[:256].view(4, 64).int()
    ctx = torch.tensor([1, 17, 500, 1024], dtype=torch.int32, device="cuda")
    q_nope = torch.randn(4, h, nope, device="cuda", generator=g).bfloat16()
    q_rope = torch.randn(4, h, rope, device="cuda", generator=g).bfloat16()
    w = (torch.randn(h, nope + v, r, device="cuda", generator=g) * 0.05).bfloat16()
    assert mla_decode_ok(q_nope, cache, r)
    args = (q_nope, q_rope, cache, tables, ctx, w[:, :nope], w[:, nope:], (nope + rope) ** -0.5)
    want, got = mla_decode_ref(*args).float(), mla_decode(*args, max_context=1024).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_tokens_within_tolerance(graphs, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_models.save(hf_models.build("deepseek-v3", **WIDE), tmp_path)
    hf = type(hf_models.build("deepseek-v3", **WIDE)).from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    model = load_model(tmp_path, dtype=torch.float32, device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 150))] for _ in range(8)]
    engine = LLMEngine(model, config=EngineConfig(num_blocks=256, max_num_batched_tokens=64, cuda_graphs=graphs))
    done = engine_greedy(engine, prompts, 16)
    for i, p in enumerate(prompts):
        gap = first_divergence_gap(hf, p, done[str(i)], hf_greedy_cuda(hf, p, 16), torch.float32)
        if gap is not None:
            step, value, tol = gap
            assert value <= tol, f"request {i} step {step}: logit gap {value:.4g} > {tol:.4g}"
