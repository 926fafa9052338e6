"""Speculation is exact in the batch-invariant mode: greedy n-gram and draft-model speculation give the tokens of no
speculation, on a target built with near-ties. Its output layer pairs every token with a twin whose weights differ
by ~1e-8 (fp32), so the top two logits are a rounding apart at every step: a verify pass of several rows a sequence
that rounds differently from a one-row decode step picks the other twin. With the mode off it does, early."""
import pytest
import torch

from brrr import LLM, SamplingParams
from tests import hf_models

VOCAB = 320
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("near-tie-target")
    hf_models.save_tokenizer(path)
    model = hf_models.build("llama3-rope", vocab_size=VOCAB, max_position_embeddings=512)
    half = VOCAB // 2
    with torch.no_grad():
        w = model.lm_head.weight
        noise = torch.randn(half, w.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        w[half:] = (w[:half].double() + 1e-8 * noise).float()
    hf_models.save(model, path)
    return path


def _prompts(n):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (12,), generator=g).tolist() * 2 for _ in range(n)]  # repeats: n-gram drafts


def _greedy(path, prompts, max_tokens, invariant, spec):
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=128, batch_invariant=invariant,
              speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


def _specs(path):
    return {"ngram": NGRAM, "draft": {"method": "draft", "num_speculative_tokens": 3, "model": str(path)}}


def test_speculation_equals_no_speculation_token_for_token_in_the_mode(tied_dir):
    prompts = _prompts(2)
    want, _ = _greedy(tied_dir, prompts, 256, True, None)
    for name, spec in _specs(tied_dir).items():
        got, stats = _greedy(tied_dir, prompts, 256, True, spec)
        assert stats["spec_decode_num_accepted_tokens"] > 50, (name, stats)  # verify passes did the work
        assert got == want, name


def test_without_the_mode_speculation_picks_the_other_twin(tied_dir):
    prompts = _prompts(2)
    want, _ = _greedy(tied_dir, prompts, 48, False, None)
    for name, spec in _specs(tied_dir).items():
        got, _ = _greedy(tied_dir, prompts, 48, False, spec)
        assert got != want, name
