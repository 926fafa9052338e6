"""The EAGLE head (brrr/models/eagle.py) and its proposer (brrr/engine/spec/eagle.py), without the engine: the
proposer's cached, batched, truncating drafts equal a plain recomputation of the head over each whole sequence."""
import pytest
import torch
from safetensors.torch import load_file

import brrr
from brrr.engine.spec.eagle import BLOCK_SIZE, EagleProposer
from brrr.engine.spec.proposer import SpecInput
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.models.eagle import load_head, new_head, save_head
from tests import hf_models


def _target(tmp_path_factory, name, **overrides):
    path = tmp_path_factory.mktemp(name)
    hf_models.save(hf_models.build("llama3-rope", **overrides), path)
    return brrr.load_model(path, dtype="float32")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return _target(tmp_path_factory, "eagle-target")


@pytest.fixture(scope="module")
def head(target):
    h = new_head(target, seed=1)
    with torch.no_grad():  # a larger random fc than training starts from, so drafts depend on every input
        h.fc.weight.normal_(0, 0.2)
    return h.requires_grad_(False).eval()


def features(target, tokens):
    """The target's final hidden states for every position of one sequence."""
    device = target.model.embed_tokens.weight.device
    ids = torch.tensor(tokens, device=device)
    with torch.no_grad():
        return target(ids, torch.arange(len(tokens), device=device), AttnMeta.causal([len(tokens)], device))


def reference_drafts(target, head, tokens, k, start=0):
    """The head recomputed from scratch over (t_{p+1}, f_p) for p = start .. L-2, then k greedy drafts, each
    appending (draft, predicted feature) and running the whole sequence again."""
    f, device = features(target, tokens), target.model.embed_tokens.weight.device
    toks, feats = list(tokens[start + 1:]), [f[p] for p in range(start, len(tokens) - 1)]
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            m = len(toks)
            out = head(target.model.embed_tokens(torch.tensor(toks, device=device)), torch.stack(feats),
                       torch.arange(start, start + m, device=device), AttnMeta.causal([m], device))
            d = int(target.compute_logits(out[-1:]).argmax(-1))
            drafts.append(d)
            toks.append(d)
            feats.append(out[-1])
    return drafts


def tokens(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fresh_proposer_matches_recomputation_batched(target, head):
    seqs = [tokens(0, 9), tokens(1, 23), tokens(2, 2)]  # 23 tokens: the head's cache spans two blocks
    prop = EagleProposer(head, target)
    inputs = [SpecInput(i, s, features(target, s)[:-1]) for i, s in enumerate(seqs)]
    got = prop.propose(inputs, 4)
    assert got == [reference_drafts(target, head, s, 4) for s in seqs]
    assert len(set(map(tuple, got))) == 3  # the drafts differ per sequence: the test sees the inputs
    for i in range(3):
        prop.release(i)
    assert prop.blocks_in_use() == 0 and not prop.seqs


def test_steps_with_rejections_match_a_fresh_proposer(target, head):
    """Engine-like steps: each call brings the features of the tokens committed since the last one (accepted drafts
    plus the target's token); the head drops its own drafted positions and reads the real features."""
    full = tokens(3, 40)
    prop = EagleProposer(head, target)
    f = features(target, full)
    length, prev = 7, None
    for accepted in (0, 3, 1, 4, 0, 2):
        n = length - 1 if prev is None else length - prev
        got = prop.propose([SpecInput(5, full[:length], f[length - 1 - n:length - 1])], 5)[0]
        fresh = EagleProposer(head, target).propose([SpecInput(5, full[:length], f[:length - 1])], 5)[0]
        assert got == fresh == reference_drafts(target, head, full[:length], 5)
        prev, length = length, length + accepted + 1
    blocks = prop.blocks_in_use()
    assert blocks == -(-(prev - 2 + 5) // BLOCK_SIZE)  # committed positions + the last call's drafts, no more
    prop.release(5)
    assert prop.blocks_in_use() == 0


def test_features_resent_or_missing(target, head):
    seq = tokens(4, 20)
    f = features(target, seq)
    prop = EagleProposer(head, target)
    prop.propose([SpecInput(1, seq[:12], f[:11])], 3)
    # rows the head already read, sent again (a recomputed step): truncated and read once more
    assert prop.propose([SpecInput(1, seq, f[5:19])], 3)[0] == reference_drafts(target, head, seq, 3)
    # a prefix the target took from its cache: the head starts where the features do, at their positions
    other = EagleProposer(head, target)
    assert other.propose([SpecInput(2, seq, f[8:19])], 3)[0] == reference_drafts(target, head, seq, 3, start=8)
    # no features (the engine decoded this sequence without speculating): no drafts, state untouched
    assert other.propose([SpecInput(2, seq, None)], 3) == [[]]
    with pytest.raises(BrrrError, match="hidden rows"):
        other.propose([SpecInput(3, seq[:3], f[:5])], 2)


def test_head_saves_loads_and_refuses_another_target(target, head, tmp_path, tmp_path_factory):
    save_head(head, tmp_path / "head")
    assert not any("embed" in k or "lm_head" in k for k in load_file(tmp_path / "head" / "model.safetensors"))
    loaded = load_head(tmp_path / "head", target)
    seq = tokens(6, 15)
    inp = [SpecInput(0, seq, features(target, seq)[:-1])]
    assert EagleProposer(str(tmp_path / "head"), target).propose(inp, 4) == EagleProposer(head, target).propose(inp, 4)
    assert loaded.fc.weight.equal(head.fc.weight)
    same_shape = _target(tmp_path_factory, "eagle-other", initializer_range=0.05)
    with pytest.raises(BrrrError, match="target.embedding_sha256"):
        load_head(tmp_path / "head", same_shape)
    wider = _target(tmp_path_factory, "eagle-wider", hidden_size=96)
    with pytest.raises(BrrrError, match="target.hidden_size"):
        EagleProposer(str(tmp_path / "head"), wider)
    with pytest.raises(BrrrError, match="not an EAGLE head"):
        load_head(tmp_path_factory.getbasetemp() / "eagle-target0", target)
