"""The GPU fast path (Triton kernels, CUDA graphs) against transformers, with a stated tolerance.

The reference path (`use_reference()`) runs transformers' own SDPA calls and GEMM shapes, so it can match
transformers token for token. The Triton kernels sum in another order (and exp2 instead of exp), so on a tiny
random model, whose logits are nearly flat, a greedy step whose top two logits are closer than the rounding noise
may pick the other one. The rule here: greedy tokens equal transformers' up to the first step where they differ,
and at that step transformers' own logits (over the same prefix) put the token brrr chose within the logit
tolerance of their maximum (fp32: 1e-3; bf16: 5% of the largest |logit|, as tests/gpu/test_cuda_parity.py).
Each divergence is printed with its gap (run with -s to see them).
"""
import random

import pytest
import torch

from brrr import SamplingParams, generate_tokens, load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.kernels.dispatch import use_reference
from tests import hf_models

pytestmark = pytest.mark.gpu


def first_divergence_gap(hf, prompt, got, want, dtype):
    """None if got == want, else (step, gap, tol): transformers' logit gap between its best token and ours."""
    if got == want:
        return None
    t = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = torch.tensor([prompt + want[:t]], device="cuda")
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].float()
    gap = (logits.max() - logits[got[t]]).item()
    tol = 1e-3 if dtype == torch.float32 else 5e-2 * logits.abs().max().item()
    return t, gap, tol


def engine_greedy(engine, prompts, n):
    """Each prompt's n greedy tokens from the engine, all requests in at once: {str(index): token ids}."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


def hf_greedy_cuda(hf, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_generate_bf16_tokens_within_tolerance(family, tmp_path):
    hf_models.save(hf_models.build(family), tmp_path)
    hf = type(hf_models.build(family)).from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda").eval()
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    params = SamplingParams(max_tokens=32, temperature=0)
    fast = list(generate_tokens(model, prompt, params))
    with use_reference():
        slow = list(generate_tokens(model, prompt, params))
    fast_gap = first_divergence_gap(hf, prompt, fast, want, torch.bfloat16)
    slow_gap = first_divergence_gap(hf, prompt, slow, want, torch.bfloat16)
    print(f"\n{family} bf16: triton {fast_gap or 'identical'}; reference {slow_gap or 'identical'}")
    for gap in (fast_gap, slow_gap):
        if gap is not None:
            step, value, tol = gap
            assert value <= tol, f"step {step}: transformers' logit gap {value:.4g} > tolerance {tol:.4g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("graphs", [True, False])
def test_engine_tokens_within_tolerance(dtype, path, graphs, tmp_path):
    """test_engine_cuda's workload (16 prompts of 1-200 tokens, chunked by a 128-token budget) on each path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_models.save(hf_models.build("qwen3-qknorm", max_position_embeddings=512), tmp_path)
    hf = type(hf_models.build("qwen3-qknorm")).from_pretrained(tmp_path, dtype=dtype).cuda().eval()
    model = load_model(tmp_path, dtype=dtype, device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 200))] for _ in range(16)]
    done = {}
    with use_reference() if path == "reference" else torch.no_grad():
        # a fixed pool (not sized by profiling): tests sharing the GPU (pytest -n) would change a profiled size
        engine = LLMEngine(model, config=EngineConfig(num_blocks=1024, max_num_batched_tokens=128,
                                                      cuda_graphs=graphs))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0))
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    gaps = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        gap = first_divergence_gap(hf, p, done[str(i)].outputs[0].token_ids, want, dtype)
        if gap is not None:
            gaps.append((i, len(p), *gap))
    print(f"\nengine {dtype} {path} graphs={graphs}: {len(gaps)} of 16 differ; (request, prompt len, step, gap, tol): "
          f"{gaps}")
    for i, n, step, value, tol in gaps:
        assert value <= tol, f"request {i} ({n} prompt tokens) step {step}: logit gap {value:.4g} > {tol:.4g}"
