"""The same parity checks as tests/test_parity.py, on CUDA: fp32 (TF32 off) logits and bf16 greedy tokens.
Exact tokens are the reference path's promise (same ops as transformers); the Triton fast path sums in another
order and is held to a logit tolerance instead (tests/gpu/test_fast_path_parity.py)."""
import pytest
import torch

from brrr import SamplingParams, forward_logits, generate_tokens, load_model
from brrr.kernels.dispatch import use_reference
from tests import hf_models

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_transformers(family, dtype, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    with use_reference():
        _check(family, dtype, tmp_path)


def _check(family, dtype, tmp_path):
    hf = hf_models.build(family)
    hf_models.save(hf, tmp_path)
    # Reload as a user would: .to(bf16) on a built model would also round the RoPE buffer, from_pretrained does not.
    hf = type(hf).from_pretrained(tmp_path, dtype=dtype).to("cuda").eval()
    model = load_model(tmp_path, dtype=dtype, device="cuda")
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    got = forward_logits(model, ids.tolist())
    tol = 1e-3 if dtype == torch.float32 else 5e-2 * expected.abs().max().item()
    assert (got - expected).abs().max().item() <= tol
    with torch.no_grad():
        hf_tokens = hf.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=32,
                                min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    assert list(generate_tokens(model, ids.tolist(), SamplingParams(max_tokens=32, temperature=0))) == hf_tokens
