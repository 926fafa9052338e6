"""Verify steps in CUDA graphs on CUDA, for every proposer (ngram, draft model, EAGLE head) on a small random model:
greedy outputs with graphs on equal graphs off and decoding without speculation, and the verify graphs (and a draft
model's own graphs) were actually replayed. On the reference ops the outputs must be identical; on the Triton kernels
a graphed verify step runs every row through the varlen kernel (an eager one sends one-token rows to the decode
kernel), whose fp32 rounding may flip a near-tie, so nearly all (not all) requests must match."""
import random

import pytest
import torch

from brrr import load_model
from brrr.engine import SamplingParams
from brrr.kernels.dispatch import use_reference
from brrr.models.eagle import new_head, save_head
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
    if method == "draft":
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
