"""The batch-invariant mode on CUDA: its Triton kernels at real sizes, the engine (CUDA graphs on: decode and verify
graphs captured inside the mode) giving one prompt's logprobs bit for bit alone, in a batch, chunked, after a
prefix hit and in a trainer's autograd forward, and speculation equal to no speculation."""
import pytest
import torch

from brrr import LLM, SamplingParams
from brrr.kernels.attention.invariant import attention_invariant_triton
from brrr.kernels.invariant_matmul import mm_invariant_triton
from brrr.kernels.log_softmax import log_softmax_triton
from tests.engine import test_batch_invariant as engine_case
from tests.engine import test_spec_batch_invariant as spec_case
from tests.kernels.test_invariant_attention import _check_invariant

pytestmark = pytest.mark.gpu

model_dir = engine_case.model_dir
tied_dir = spec_case.tied_dir


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_matmul_rows_do_not_depend_on_m(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", generator=g).to(dtype)
    w = torch.randn(2048, 4096, device="cuda", generator=g).to(dtype)
    full = mm_invariant_triton(x, w.t())
    for m in (1, 2, 3, 7, 8, 16, 64, 65, 129, 256):
        assert torch.equal(mm_invariant_triton(x[:m], w.t()), full[:m]), m
        assert torch.equal(mm_invariant_triton(x[300 - m:], w.t()), full[300 - m:]), m
    want = (x.float() @ w.float().t()).to(dtype)
    tol = 1e-2 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(full.float(), want.float(), atol=tol, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_rows_are_invariant_on_cuda(dtype):
    _check_invariant(attention_invariant_triton, "cuda", dtype)


def test_log_softmax_rows_at_a_real_vocabulary():
    x = torch.randn(64, 151_936, device="cuda") * 4
    full = log_softmax_triton(x)
    for m in (1, 3, 17):
        assert torch.equal(log_softmax_triton(x[:m]), full[:m])
    torch.testing.assert_close(full, torch.log_softmax(x, -1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_logprobs_are_bit_identical_on_cuda(model_dir, dtype):
    ways = engine_case._every_way(model_dir, dtype, invariant=True, device="cuda")
    tokens, want = ways.pop("alone")
    for way, (got_tokens, got) in ways.items():
        assert got_tokens == tokens, way
        assert torch.equal(got, want), f"{way}: max |delta| {(got - want).abs().max().item()}"


def test_engine_mismatch_without_the_mode_on_cuda(model_dir):
    ways = engine_case._every_way(model_dir, torch.bfloat16, invariant=False, device="cuda")
    tokens, want = ways.pop("alone")
    deltas = {way: (got - want).abs().max().item() for way, (t, got) in ways.items() if t == tokens}
    assert max(deltas.values()) > 0, deltas  # packed GEMMs, split-KV decode and cuBLAS's M-dependent tiles


def test_speculation_is_exact_on_cuda(tied_dir):
    prompts = spec_case._prompts(4)
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)

    def greedy(spec):
        llm = LLM(str(tied_dir), dtype="float32", device="cuda", num_blocks=256, batch_invariant=True,
                  speculative_config=spec)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm.engine.stats()

    want, _ = greedy(None)
    for name, spec in spec_case._specs(tied_dir).items():
        got, stats = greedy(spec)
        assert stats["spec_decode_num_accepted_tokens"] > 50, (name, stats)
        assert got == want, name
