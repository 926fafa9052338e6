"""EAGLE proposals in CUDA graphs (brrr/engine/spec/eagle_graphs.py), checked on CPU through the capture seam: the
captured step re-runs eagerly on the same static buffers, so the padded catch-up layout, rows of 1..k+1 new
features, batches between captured sizes, the per-bound graphs and the spare block are exercised as a replay would
see them. Drafts equal the eager path's and a plain recomputation; padding never writes a block a sequence holds."""
import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.engine.spec.eagle import EagleProposer
from brrr.engine.spec.proposer import SpecInput
from brrr.engine.spec.verify import DeviceDrafts
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams
from tests.engine.test_graph_inputs import EagerReplay
from tests.engine.test_spec_decode import repetitive_prompts, run, setup, stress_engine, texts  # noqa: F401
from tests.engine.test_spec_eagle_engine import head_dir  # noqa: F401
from tests.engine.test_spec_eagle import features, head, reference_drafts, target, tokens  # noqa: F401

K = 3


def eager_capture(step, pool):
    graph = EagerReplay(step)
    return graph, graph.logits


def test_graph_proposals_equal_eager_ones_and_write_only_the_spare_block(target, head):  # noqa: F811
    """Two proposers in lockstep, one through graphs: engine-like calls (each sequence's first call with its whole
    prompt, which no graph takes, then 1..k+1 new features a call), three or two sequences (sizes 4 and 2)."""
    eager, graphed = EagleProposer(head, target), EagleProposer(head, target)
    graphed.capture_graphs(4, K, max_blocks=32, num_blocks=40, capture=eager_capture)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4] and len(graphed.graphs.graphs[4]) >= 2  # bounds per size
    spare = graphed.spare_block
    seqs = [tokens(20 + i, 70) for i in range(3)]
    full = [features(target, s) for s in seqs]
    length, sent = [5, 17, 9], [0, 0, 0]
    accepted = [[0, 3, 1, 3, 2, 0, 3], [2, 0, 3, 1, 3, 3, 1], [1, 1, 0, 3, 2, 3, 0]]
    for call in range(8):
        live = range(3) if call != 4 else (0, 2)  # one sequence sits a call out: its next call brings 2 steps' rows
        inputs = [SpecInput(i, seqs[i][:length[i]], full[i][sent[i]:length[i] - 1]) for i in live]
        want = eager.propose(inputs, K)
        assert graphed.propose(inputs, K) == want
        for i, got in zip(live, want):
            assert got == reference_drafts(target, head, seqs[i][:length[i]], K)
            sent[i] = length[i] - 1
        for i in range(3):
            length[i] += accepted[i][call % 7] + 1
        # every block a sequence holds (drafted positions included) as the eager path wrote it
        torch.testing.assert_close(graphed.k_cache[:spare], eager.k_cache[:spare], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.v_cache[:spare], eager.v_cache[:spare], atol=1e-5, rtol=1e-5)
    assert graphed.graphs.replays == 6  # every call after the first, except call 5 (sequence 1: 2 + 4 rows > q)
    assert graphed.k_cache[spare].abs().sum() > 0  # padding wrote there
    for i in range(3):
        graphed.release(i)
    assert graphed.blocks_in_use() == 0


def test_graphs_are_captured_before_proposals_and_dropped_if_the_pool_grows(target, head):  # noqa: F811
    prop = EagleProposer(head, target)
    seq = tokens(7, 40)
    f = features(target, seq)
    prop.propose([SpecInput(0, seq[:10], f[:9])], K)
    with pytest.raises(BrrrError, match="before any sequence"):
        prop.capture_graphs(2, K, 8, capture=eager_capture)
    small = EagleProposer(head, target)
    small.capture_graphs(2, K, max_blocks=8, num_blocks=2, capture=eager_capture)
    small.propose([SpecInput(0, seq[:10], f[:9])], K)
    assert small.graphs is not None
    # a second sequence needs more than the two blocks: the pool grows, the graphs (its old address) go
    assert small.propose([SpecInput(1, seq[:30], f[:29])], K) == [reference_drafts(target, head, seq[:30], K)]
    assert small.graphs is None
    assert small.propose([SpecInput(0, seq[:12], f[9:11])], K) == [reference_drafts(target, head, seq[:12], K)]


def test_engine_with_eagle_graphs_equals_decoding_without_speculation(setup, tmp_path, monkeypatch):  # noqa: F811
    """Greedy tokens equal decoding without speculation, proposals and verify steps through graphs; the drafts
    stay on the device until the verify step's tokens are read (a request with a penalty, whose verify step reads
    its drafts' values first, takes the host path while it runs)."""
    path, model, tokenizer = setup
    from brrr.models.eagle import new_head, save_head

    save_head(new_head(model, seed=1), tmp_path)
    prompts = repetitive_prompts(7, tokenizer.vocab_size, seed=9)
    reqs = [(str(i), p, SamplingParams(max_tokens=10 + i % 3 * 6, temperature=0, ignore_eos=True,
                                       repetition_penalty=1.3 if i == 2 else 1.0)) for i, p in enumerate(prompts)]
    config = dict(num_blocks=120, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    want = texts(run(LLMEngine(model, tokenizer, EngineConfig(**config)), reqs))
    spec = {"method": "eagle", "num_speculative_tokens": 4, "model": str(tmp_path)}
    engine = LLMEngine(model, tokenizer, EngineConfig(**config, speculative_config=spec))
    engine.runner.capture_cuda_graphs(6, 32, capture=eager_capture)
    proposer = engine.spec.proposer
    proposer.capture_graphs(6, 4, 64, capture=eager_capture)
    events = []
    for obj, name in ((proposer, "propose_on_device"), (proposer, "propose"), (engine.runner, "execute"),
                      (DeviceDrafts, "host")):
        real = getattr(obj, name)

        def record(*args, real=real, name=name, **kw):
            events.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(obj, name, record)
    assert texts(run(engine, reqs)) == want
    stats = engine.stats()
    assert stats["spec_draft_graph_steps"] == proposer.graphs.replays > 0
    assert stats["spec_verify_graph_steps"] > 0
    assert proposer.blocks_in_use() == 0
    # P: propose (the host path, which reads its drafts at once: PDH), D: propose_on_device, X: a step's forward,
    # H: drafts read on the host. A device proposal's drafts are read only after its verify step ran (DXH).
    rounds = "".join("D" if e == "propose_on_device" else "P" if e == "propose" else "X" if e == "execute" else "H"
                     for e in events)
    device = rounds.replace("PDH", "")
    assert "PDH" in rounds and "DXH" in device and "DH" not in device


def test_eagle_graphs_under_engine_stress(setup, head_dir):  # noqa: F811
    """The stress engine (preemption, chunked prefill, prefix hits, logprobs requests decoding beside speculating
    ones) with verify and proposal graphs: greedy tokens equal no speculation, every head block is freed."""
    _, model, tokenizer = setup
    prompts = repetitive_prompts(30, tokenizer.vocab_size, seed=4)
    reqs = [(str(i), p, SamplingParams(max_tokens=8 + i % 5 * 8, temperature=0, ignore_eos=True,
                                       **({"logprobs": 2} if i % 7 == 3 else {}))) for i, p in enumerate(prompts)]
    want = run(stress_engine(model, tokenizer, None), reqs)
    engine = stress_engine(model, tokenizer, {"method": "eagle", "num_speculative_tokens": 3,
                                              "model": str(head_dir)})
    engine.runner.capture_cuda_graphs(10, 32, capture=eager_capture)
    engine.spec.proposer.capture_graphs(10, 3, 64, capture=eager_capture)
    assert texts(run(engine, reqs)) == texts(want)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_draft_graph_steps"] > 20 and stats["spec_verify_graph_steps"] > 20, stats
    assert engine.spec.proposer.blocks_in_use() == 0 and not engine.spec.proposer.seqs
