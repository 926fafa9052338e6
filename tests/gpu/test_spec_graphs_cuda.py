"""Verify steps in CUDA graphs on CUDA, for every proposer (ngram, draft model, EAGLE head) on a small random model:
greedy outputs with graphs on equal graphs off and decoding without speculation, and the verify graphs (and a draft
model's or an EAGLE head's proposal graphs) were actually replayed. On the reference ops the outputs must be identical;
on the Triton kernels a graphed verify step runs every row through the varlen kernel (an eager one sends one-token
rows to the decode kernel), whose fp32 rounding may flip a near-tie, so nearly all (not all) requests must match."""
import random
from contextlib import nullcontext

import pytest
import torch

from brrr import load_model
from brrr.kernels.dispatch import use_reference
from brrr.models.eagle import new_head, save_head
from brrr.sampling_params import SamplingParams
from tests import hf_models
from tests.gpu.test_spec_decode_cuda import _outputs as run_engine

pytestmark = pytest.mark.gpu
METHODS = ["ngram", "draft", "eagle"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = tmp_path_factory.mktemp("spec-graphs-target")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=512), target)
    # a noisy copy of the target as the draft: drafts partly accepted, so runs of every length are verified
    noisy = hf_models.build("llama3-rope", max_position_embeddings=512)
    with torch.no_grad():
        noisy.lm_head.weight.add_(0.08 * torch.randn(noisy.lm_head.weight.shape,
                                                     generator=torch.Generator().manual_seed(1)))
    draft = hf_models.save(noisy, tmp_path_factory.mktemp("spec-graphs-draft"))
    head = tmp_path_factory.mktemp("spec-graphs-eagle")
    model = load_model(target, dtype=torch.float32, device="cuda")
    save_head(new_head(model, seed=1), head)
    return {"model": model, "draft": draft, "eagle": head}


def _spec(method, dirs):
    spec = {"method": method, "num_speculative_tokens": 4}
    if method in ("draft", "eagle"):
        spec["model"] = str(dirs[method])
    return spec


def _requests(count):
    rng = random.Random(0)
    reqs = []
    for i in range(count):
        unit = [rng.randrange(256) for _ in range(rng.randint(2, 9))]
        prompt = (unit * 40)[:rng.randint(16, 200)]
        reqs.append((str(i), prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    return reqs


def _outputs(model, spec, graphs, reqs):
    return run_engine(model, spec, reqs, cuda_graphs=graphs)


def _check_replays(method, stats):
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_verify_graph_steps"] > 0, stats
    if method in ("draft", "eagle"):
        assert stats["spec_draft_graph_steps"] > 0, stats


@pytest.mark.parametrize("method", METHODS)
def test_graphs_on_equal_graphs_off_and_no_speculation_on_reference_ops(dirs, method):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reqs = dirs["model"], _requests(12)
    with use_reference():
        want, _ = _outputs(model, None, True, reqs)
        eager, eager_stats = _outputs(model, _spec(method, dirs), False, reqs)
        graphed, stats = _outputs(model, _spec(method, dirs), True, reqs)
    assert eager == want
    assert graphed == want
    assert eager_stats["spec_verify_graph_steps"] == 0
    _check_replays(method, stats)


@pytest.mark.parametrize("method", METHODS)
def test_graphs_on_match_graphs_off_and_no_speculation_on_triton_kernels(dirs, method):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reqs = dirs["model"], _requests(24)
    want, _ = _outputs(model, None, True, reqs)
    eager, _ = _outputs(model, _spec(method, dirs), False, reqs)
    graphed, stats = _outputs(model, _spec(method, dirs), True, reqs)
    for got in (eager, graphed):
        same = sum(got[k] == want[k] for k in want)
        assert same >= 0.9 * len(want), f"{same}/{len(want)} requests identical"
    _check_replays(method, stats)


@pytest.mark.parametrize("method", METHODS)
def test_batch_one_verifies_in_the_size_one_graph(dirs, method):
    """The latency bench's case: one sequence, every verify step a replay (on the reference ops, identical tokens;
    on the Triton kernels too)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, reqs = dirs["model"], _requests(1)
    with use_reference():
        want, _ = _outputs(model, None, True, reqs)
        got, stats = _outputs(model, _spec(method, dirs), True, reqs)
    assert got == want
    for stats in (stats, _outputs(model, _spec(method, dirs), True, reqs)[1]):  # and on the Triton kernels
        _check_replays(method, stats)
        assert stats["spec_verify_graph_steps"] >= stats["spec_decode_num_drafts"]
        if method == "eagle":  # every proposal but the first (the whole prompt) replays a graph
            assert stats["spec_draft_graph_steps"] >= stats["spec_decode_num_drafts"] - 1, stats


@pytest.mark.parametrize("reference", [True, False])
def test_eagle_proposal_graphs_equal_eager_proposals(dirs, reference):
    """The head's proposals captured by the engine's own call (`allocate_cache`): engine-like calls (a prompt, then
    1..k+1 new features a call; 3 sequences replay the size-4 graph) give the eager path's drafts: on the
    reference ops identical, on the Triton kernels nearly all rows (the graph's catch-up runs every row through
    the varlen kernel, the eager one sends one-feature rows to the decode kernel)."""
    from brrr.engine.spec.eagle import EagleProposer
    from brrr.engine.spec.proposer import SpecInput
    from brrr.models.eagle import load_head
    from tests.engine.test_spec_eagle import features, tokens

    torch.backends.cuda.matmul.allow_tf32 = False
    model, k = dirs["model"], 4
    head = load_head(dirs["eagle"], model)
    with torch.no_grad():  # drafts that depend on every input (as test_spec_eagle's head)
        head.fc.weight.normal_(0, 0.2, generator=torch.Generator("cuda").manual_seed(0))
    with use_reference() if reference else nullcontext():
        eager, graphed = EagleProposer(head, model), EagleProposer(head, model)
        graphed.allocate_cache(400, 16, True, 8, 256, k, 512)
        assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8]
        seqs = [tokens(30 + i, 300) for i in range(3)]
        full = [features(model, s) for s in seqs]
        length, sent, same, rows = [5, 140, 37], [0, 0, 0], 0, 0
        rng = random.Random(1)
        for call in range(12):
            inputs = [SpecInput(i, seqs[i][:length[i]], full[i][sent[i]:length[i] - 1]) for i in range(3)]
            want, got = eager.propose(inputs, k), graphed.propose(inputs, k)
            same, rows = same + sum(a == b for a, b in zip(want, got)), rows + 3
            for i in range(3):
                sent[i] = length[i] - 1
                length[i] += rng.randint(1, k + 1)
    assert graphed.graphs.replays == 11
    assert same == rows if reference else same >= 0.9 * rows, f"{same}/{rows} identical"
