"""brrr vs transformers on tiny random models of every supported family: logits (fp32) and greedy tokens."""
import pytest
import torch

from brrr import SamplingParams, forward_logits, generate_tokens, load_model
from tests import hf_models

PROMPT_LEN, NEW_TOKENS = 20, 32


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(family, tmp_path):
    hf = hf_models.build(family)
    # Shard the checkpoint for a few families so the index.json path is exercised too.
    hf_models.save(hf, tmp_path, sharded=family in ("llama3-rope", "qwen3-qknorm", "tied"))
    if family in ("llama3-rope", "qwen3-qknorm", "tied"):
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, dtype=torch.float32)
    # the reference form: Hugging Face's module names, which the checkpoint loaded into; no serving modules
    assert model.state_dict().keys() == hf.state_dict().keys()
    assert not any(type(m).__module__ == "brrr.serving_form" for m in model.modules())

    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    long = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    for ids in (prompt, long):  # 40 tokens: beyond the dynamic-rope model's 32 positions and the 16-token window
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]
        got = forward_logits(model, ids.tolist())
        assert (got - expected).abs().max().item() <= 1e-4

    with torch.no_grad():
        # An explicit mask: without one, generate() masks every prompt token equal to pad_token_id.
        hf_tokens = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, PROMPT_LEN:].tolist()
    ours = list(generate_tokens(model, prompt.tolist(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0)))
    assert ours == hf_tokens


@pytest.mark.parametrize("family", ["mistral-sliding", "qwen3-qknorm", "mqa"])
def test_batched_causal_forward_matches_per_sequence(family, tmp_path):
    """Training-style batches (equal lengths, no cache) take a batched path; it must equal one-at-a-time."""
    from brrr.kernels import AttnMeta

    hf_models.save(hf_models.build(family), tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batched = model.compute_logits(model(ids.flatten(), torch.arange(24).repeat(3), AttnMeta.causal([24] * 3, "cpu")))
    single = torch.cat([forward_logits(model, row.tolist()) for row in ids])
    assert (batched - single).abs().max().item() <= 1e-5
