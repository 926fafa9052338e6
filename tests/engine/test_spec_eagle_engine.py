"""EAGLE in the engine (needs the engine's speculative decoding: brrr/engine/spec/verify.py): greedy outputs are
token-identical to decoding without speculation under engine stress, every block of the target and of the head's
own cache is freed, and a head trained for another target is refused at start-up."""
import pytest
import torch

pytest.importorskip("brrr.engine.spec.verify")

from brrr.errors import BrrrError  # noqa: E402
from brrr.kernels import AttnMeta  # noqa: E402
from brrr.models.eagle import new_head, save_head  # noqa: E402
from brrr.sampling_params import SamplingParams  # noqa: E402
from brrr.train.draft import EagleLoss  # noqa: E402
from tests import hf_models  # noqa: E402
from tests.engine.test_spec_decode import repetitive_prompts, run, setup, stress_engine, texts  # noqa: E402, F401


def greedy_text(model, prompts, steps):
    """The target's own greedy continuations (one full forward per token): text the head can learn to predict."""
    out = []
    for p in prompts:
        seq = list(p)
        with torch.no_grad():
            for _ in range(steps):
                h = model(torch.tensor(seq), torch.arange(len(seq)), AttnMeta.causal([len(seq)], "cpu"))
                seq.append(int(model.compute_logits(h[-1:]).argmax()))
        out.append(seq)
    return out


@pytest.fixture(scope="module")
def head_dir(setup, tmp_path_factory):
    """A head fitted for a few hundred steps to the target's greedy text (so its drafts are partly accepted)."""
    _, model, tokenizer = setup
    rows = torch.tensor(greedy_text(model, [p[:8] for p in repetitive_prompts(8, tokenizer.vocab_size, seed=3)], 40))
    head = new_head(model, seed=0)
    loss, opt = EagleLoss(head, model), torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        loss(rows[:, :-1], rows[:, 1:]).backward()
        opt.step()
    path = tmp_path_factory.mktemp("eagle-head")
    save_head(head.eval(), path)
    return path


def test_greedy_is_token_identical_with_eagle(setup, head_dir):
    _, model, tokenizer = setup
    prompts = repetitive_prompts(30, tokenizer.vocab_size, seed=4)
    reqs = []
    for i, p in enumerate(prompts):
        extra = {"logprobs": 2} if i % 7 == 3 else {}  # not speculated: decodes beside the speculating ones
        reqs.append((str(i), p, SamplingParams(max_tokens=8 + i % 5 * 8, temperature=0, ignore_eos=True, **extra)))
    want = run(stress_engine(model, tokenizer, None), reqs)
    engine = stress_engine(model, tokenizer, {"method": "eagle", "num_speculative_tokens": 3,
                                              "model": str(head_dir)})
    got = run(engine, reqs)
    assert texts(got) == texts(want)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    proposer = engine.spec.proposer
    assert proposer.blocks_in_use() == 0 and not proposer.seqs  # every finished sequence was released


def test_a_head_for_another_target_is_refused(setup, head_dir, tmp_path):
    _, model, tokenizer = setup
    hf_models.save(hf_models.build("llama3-rope", vocab_size=tokenizer.vocab_size, max_position_embeddings=512,
                                   initializer_range=0.05), tmp_path)
    from brrr import load_model

    other = load_model(tmp_path, dtype=torch.float32)
    with pytest.raises(BrrrError, match="another target model"):
        stress_engine(other, tokenizer, {"method": "eagle", "num_speculative_tokens": 3, "model": str(head_dir)})
