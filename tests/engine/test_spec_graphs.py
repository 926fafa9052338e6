"""Verify steps in CUDA graphs (brrr/engine/spec/verify_graphs.py), checked on CPU: `capture_cuda_graphs` gets a capture
that re-runs the captured step eagerly on the same static buffers, so padding (rows with 0..k drafts, batches
between captured sizes), the fixed query layout and the spare block are exercised as a replay would see them.
Greedy tokens equal eager verification and decoding without speculation for every proposer; padded query slots
never write into a block a sequence holds."""
import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.engine.spec.proposer import Proposer
from brrr.engine.spec.verify import Speculator
from brrr.engine.spec.verify_graphs import MAX_VERIFY_GRAPH_ROWS, VerifyGraphSpec, verify_graph_spec
from brrr.kernels import AttnMeta
from brrr.kernels.attention import attention_ref
from brrr.kernels.attention.reference import paged_verify_ref
from brrr.sampling_params import SamplingParams
from tests.engine.test_graph_inputs import EagerReplay
from tests.engine.test_spec_decode import RecordingProposer, repetitive_prompts, run, setup, texts  # noqa: F401


def eager_capture(step, pool):
    graph = EagerReplay(step)
    return graph, graph.logits


def engine_for(model, tokenizer, spec, graphs, max_num_seqs=6, **kw):
    config = dict(num_blocks=120, block_size=8, max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                  speculative_config=spec)
    engine = LLMEngine(model, tokenizer, EngineConfig(**{**config, **kw}))
    if graphs:
        engine.runner.capture_cuda_graphs(max_num_seqs, 32, capture=eager_capture)
        draft = getattr(engine.spec.proposer, "runner", None) if engine.spec is not None else None
        if draft is not None:
            draft.capture_cuda_graphs(max_num_seqs, 64, capture=eager_capture)
    return engine


class VaryingProposer(Proposer):
    """Proposes a plain run's continuation, 0..k tokens of it by turns (so one step mixes rows of every draft
    count), the last draft of every third proposal wrong (so runs are cut short)."""

    def __init__(self, expected: dict[tuple, list[int]]):
        self.expected, self.calls = expected, 0

    def propose(self, inputs, k):
        drafts = []
        for x in inputs:
            self.calls += 1
            prompt = next(p for p in self.expected if tuple(x.token_ids[:len(p)]) == p)
            done = len(x.token_ids) - len(prompt)
            draft = list(self.expected[prompt][done:done + (x.seq_id + self.calls) % (k + 1)])
            if draft and self.calls % 3 == 0:
                draft[-1] = (draft[-1] + 1) % 256
            drafts.append(draft)
        return drafts


def test_padded_verify_graphs_give_eager_tokens_and_write_only_the_spare_block(setup):
    """Two engines in lockstep, one verifying through graphs, one eagerly: after every step the KV cache of every
    block is the same (a padded query slot that wrote into a real block would show), the spare block was written
    by padding, and the tokens equal decoding without speculation."""
    _, model, tokenizer = setup
    prompts = repetitive_prompts(5, tokenizer.vocab_size, seed=11)
    reqs = [(str(i), p, SamplingParams(max_tokens=14 + i * 3, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    want = run(engine_for(model, tokenizer, None, False), reqs)
    oracle = {tuple(p): want[rid].outputs[0].token_ids for (rid, _, _), p in zip(reqs, prompts)}
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engines = [engine_for(model, tokenizer, spec, graphs) for graphs in (True, False)]
    for engine in engines:
        engine.spec = Speculator(engine.config.speculative_config, VaryingProposer(oracle))
        for rid, prompt, params in reqs:
            engine.add_request(rid, prompt, params)
    graphs, eager = engines
    assert sorted(graphs.runner.verify_graphs.graphs) == [1, 2, 4, 6]
    sizes, done = set(), {}
    real_replay = graphs.runner.verify_graphs.replay

    def replay(batch, rows, want_hidden):
        sizes.add(tuple(sorted(n for _, n in batch.items)))
        return real_replay(batch, rows, want_hidden)

    graphs.runner.verify_graphs.replay = replay
    spare = graphs.runner.num_blocks
    while graphs.has_unfinished_requests() or eager.has_unfinished_requests():
        for engine in engines:
            for out in engine.step():
                if out.finished:
                    done.setdefault(engine is graphs, {})[out.request_id] = out
        for (k_graph, v_graph), (k_eager, v_eager) in zip(graphs.runner.kv_caches, eager.runner.kv_caches):
            torch.testing.assert_close(k_graph[:spare], k_eager[:spare], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v_graph[:spare], v_eager[:spare], atol=1e-5, rtol=1e-5)
    assert texts(done[True]) == texts(done[False]) == texts(want)
    assert graphs.stats()["spec_verify_graph_steps"] > 5 and eager.stats()["spec_verify_graph_steps"] == 0
    assert graphs.runner.kv_caches[0][0][spare].abs().sum() > 0  # padding wrote there
    # rows of every draft count met in one graph step, and batches between captured sizes (3, 5)
    assert {1, 2, 3, 4} <= {n for ns in sizes for n in ns}, sizes
    assert {len(ns) for ns in sizes} & {3, 5}, sizes


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_each_method_through_graphs_equals_decoding_without_speculation(setup, method, tmp_path):
    path, model, tokenizer = setup
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft":
        spec["model"] = str(path)  # the target as its own draft: every draft accepted, two-token catch-ups
    if method == "eagle":
        from brrr.models.eagle import new_head, save_head
        save_head(new_head(model, seed=1), tmp_path)
        spec["model"] = str(tmp_path)
    prompts = repetitive_prompts(7, tokenizer.vocab_size, seed=5)
    reqs = [(str(i), p, SamplingParams(max_tokens=10 + i % 3 * 6, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    want = texts(run(engine_for(model, tokenizer, None, False), reqs))
    engine = engine_for(model, tokenizer, spec, True)
    chained, read = [], []
    if method == "draft":  # its steps after the first are queued back to back, each reading the last's tokens
        draft, launch = engine.spec.proposer.runner, engine.spec.proposer.runner.launch_forward
        draft.launch_forward = lambda batch, ids_from=None: chained.append(ids_from is not None) or launch(
            batch, ids_from)
        execute = draft.execute  # a step read back: only a sequence's first, over its whole prompt
        draft.execute = lambda batch, rows: read.append(max(n for _, n in batch.items)) or execute(batch, rows)
    assert texts(run(engine, reqs)) == want
    stats = engine.stats()
    assert stats["spec_verify_graph_steps"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    if method == "draft":
        draft = engine.spec.proposer.runner
        assert draft.decode_replays > 0 and draft.verify_graphs.replays > 0
        assert stats["spec_draft_graph_steps"] == draft.decode_replays + draft.verify_graphs.replays
        assert len(chained) > 10 and all(chained)
        assert read and min(read) > 2  # the first step of later calls replayed a graph, unread
        # the right drafts, not merely an exact output: the target as its own draft has every one accepted
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    if method == "eagle":
        assert engine.runner.verify_graphs.hidden


def test_hidden_rows_from_a_verify_graph_are_those_of_the_kept_positions(setup):
    """A proposer that reads hidden states (EAGLE's contract) checks every row it is handed against a full forward;
    verify steps, and steps of plain decodes that want hidden states, run through graphs that keep them."""
    _, model, tokenizer = setup
    prompts = repetitive_prompts(6, tokenizer.vocab_size, seed=3)
    reqs = [(str(i), p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine = engine_for(model, tokenizer, {"method": "ngram", "num_speculative_tokens": 4}, False,
                        enable_prefix_caching=False)
    engine.runner.verify_spec = VerifyGraphSpec(5, True, 4)
    engine.runner.capture_cuda_graphs(6, 32, capture=eager_capture)
    proposer = RecordingProposer(engine.model)
    engine.spec = Speculator(engine.config.speculative_config, proposer)
    got = run(engine, reqs)
    assert texts(got) == texts(run(engine_for(model, tokenizer, None, False), reqs))
    assert proposer.calls > 0 and engine.runner.verify_graphs.replays > 0
    assert sorted(engine.runner.verify_graphs.graphs) == [1, 2, 4]


def test_verify_graph_sizes_are_bounded():
    assert verify_graph_spec(5, False, 256, 2048).max_batch == MAX_VERIFY_GRAPH_ROWS // 5
    assert verify_graph_spec(5, True, 256, 2048, disable_by_batch_size=8) == VerifyGraphSpec(5, True, 8)
    assert verify_graph_spec(5, False, 256, 40).max_batch == 8  # a padded step fits the token budget
    assert verify_graph_spec(17, False, 256, 16) is None


@pytest.mark.parametrize("window", [None, 5])
def test_uniform_query_reference_equals_the_varlen_reference(window):
    """The captured step's CPU attention (every row Q new tokens, read from k/v) equals the eager varlen path's
    over the same cache, for rows of different cached prefixes, with GQA and a sliding window."""
    torch.manual_seed(0)
    batch, tq, heads, kv_heads, dim, block = 3, 4, 4, 2, 16, 8
    prefixes = [0, 5, 19]
    k_cache = torch.randn(10, block, kv_heads, dim)
    v_cache = torch.randn(10, block, kv_heads, dim)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    q = torch.randn(batch * tq, heads, dim)
    k, v = torch.randn(batch * tq, kv_heads, dim), torch.randn(batch * tq, kv_heads, dim)
    slots = torch.tensor([tables[b, (p + i) // block].item() * block + (p + i) % block
                          for b, p in enumerate(prefixes) for i in range(tq)])
    meta = AttnMeta(cu_seqlens_q=torch.arange(0, (batch + 1) * tq, tq, dtype=torch.int32), seqlens_q=[tq] * batch,
                    context_lens=[p + tq for p in prefixes], slot_mapping=slots, block_tables=tables,
                    kv_caches=[(k_cache.clone(), v_cache.clone())])
    want = attention_ref(q, k, v, meta, 0, 0.25, window)
    got = paged_verify_ref(q, k, v, k_cache, v_cache, tables, torch.tensor(meta.context_lens), 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tp2_draft_model_keeps_its_drafts_on_the_host(tmp_path_factory):
    """A tensor-parallel runner sends its workers host ids: the draft model's drafts are read on the host there
    (`Speculator(device_drafts=False)`), and the greedy tokens equal one rank's."""
    from brrr.engine import LLM
    from tests.engine.test_tensor_parallel import STRESS, _model_dir, _prompts

    llama = _model_dir(tmp_path_factory, "llama3-rope")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(llama), **STRESS).generate(_prompts(), params, use_tqdm=False)]
    llm = LLM(str(llama), tensor_parallel_size=2, **STRESS,
              speculative_config={"method": "draft", "num_speculative_tokens": 3, "model": str(llama)})
    try:
        assert not llm.engine.spec.device_drafts
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.engine.runner.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_sleep_drops_the_graphs_and_wake_captures_them_over_the_new_cache(setup):
    """A colocated engine's sleep frees the cache its graphs read; wake captures them again over the new one, so
    replays after a wake decode as a graph-free engine does (brrr/train/rollout.py)."""
    _, model, tokenizer = setup
    prompts = repetitive_prompts(4, tokenizer.vocab_size, seed=5)
    reqs = [(str(i), p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    engine = engine_for(model, tokenizer, None, True, enable_prefix_caching=False)
    before = run(engine, reqs)
    runner = engine.runner
    runner.sleep()
    assert runner.graphs == {} and runner.kv_caches == []
    runner.wake()
    metas = [meta for plans in runner.graphs.values() for _, _, meta in plans.values()]
    assert sorted(runner.graphs) == [1, 2, 4, 6] and all(m.kv_caches is runner.kv_caches for m in metas)
    replays = runner.decode_replays
    after = run(engine, [(r + "-again", p, sp) for r, p, sp in reqs])
    assert runner.decode_replays > replays
    after = {r.removesuffix("-again"): out for r, out in texts(after).items()}
    assert after == texts(before) == texts(run(engine_for(model, tokenizer, None, False), reqs))
