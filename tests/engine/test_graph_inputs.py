"""The CUDA-graph decode path's inputs, checked on CPU: graphs are replaced by eager re-runs of the captured
step on the same static buffers, so padding, slot mapping, block tables and context lengths are exercised
exactly as a replay would see them."""
import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.sampling_params import SamplingParams
from tests.engine.test_engine import VOCAB, hf_greedy, models, run_all  # noqa: F401  (fixture)


class EagerReplay:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes the captured step into the same output tensor."""

    def __init__(self, step):
        self.step, self.logits = step, step()

    def replay(self):
        self.logits.copy_(self.step())

    def pool(self):
        return None


def test_graph_replay_inputs_give_transformers_tokens(models):  # noqa: F811
    hf, model = models
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, max_num_seqs=6, max_num_batched_tokens=64,
                                                  max_model_len=256))
    engine.runner.capture_cuda_graphs(6, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
    assert sorted(engine.runner.graphs) == [1, 2, 4, 6]
    prompts = [[5, 9, 2], list(range(40, 75)), [7] * 17, list(range(100, 116)), [3]]
    reqs = [(str(i), p, SamplingParams(max_tokens=12, temperature=0)) for i, p in enumerate(prompts)]
    replays = {"n": 0}
    real = engine.runner._replay

    def counting(batch, ids_from=None):
        replays["n"] += 1
        replays["pipelined"] = replays.get("pipelined", 0) + (ids_from is not None)
        return real(batch, ids_from)

    engine.runner._replay = counting
    done = run_all(engine, reqs)
    assert replays["n"] > 5  # most decode steps went through the graph path (batches of 5, 4, ... padded up)
    assert replays["pipelined"] > 5  # and most of those were queued before the previous step's tokens were read
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, p, 12), f"request {i}"


def test_pipelined_decode_equals_step_by_step(models):  # noqa: F811
    """Steps queued ahead of the host (graph path) give the tokens the plain path gives: seeded sampling keys,
    stop tokens met while the next step is in flight, a request aborted mid-flight, and every block freed."""
    _, model = models
    stop = hf_greedy(models[0], [9, 8, 7], 12)[5]  # request "stop" meets its stop token at the 6th token
    reqs = [("greedy", [5, 9, 2], SamplingParams(max_tokens=14, temperature=0)),
            ("seeded", list(range(40, 60)), SamplingParams(max_tokens=16, temperature=0.9, seed=7)),
            ("stop", [9, 8, 7], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])),
            ("topk", [7] * 17, SamplingParams(max_tokens=9, temperature=1.2, top_k=5, seed=3)),
            ("aborted", [3, 3, 3], SamplingParams(max_tokens=30, temperature=0))]
    outs = []
    for graphs in (False, True):
        engine = LLMEngine(model, config=EngineConfig(num_blocks=64, max_num_seqs=6, max_model_len=256))
        if graphs:
            engine.runner.capture_cuda_graphs(6, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
        outs.append(run_all(engine, reqs, abort_at={"aborted": 8}))
        assert engine._queued is None or not engine._queued.live()
    plain, pipelined = outs
    assert set(plain) == set(pipelined) == {"greedy", "seeded", "stop", "topk"}
    for rid in plain:
        assert pipelined[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids, rid
    stopped = plain["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop and len(stopped.token_ids) <= 6


@pytest.mark.parametrize("bound", ["lean", "short"])
def test_context_bounded_graphs(tmp_path, bound):
    """A sequence growing past LEAN_CONTEXT (SHORT_CONTEXT) switches from the graph planned for the lean decode kernel
    (the split kernel tiled for short contexts) to the next looser one, with the same tokens as without graphs."""
    from brrr import load_model
    from brrr.kernels.attention.plan import LEAN_CONTEXT, SHORT_CONTEXT
    from tests import hf_models
    model = load_model(hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=4096), tmp_path),
                       dtype=torch.float32)
    limit = LEAN_CONTEXT if bound == "lean" else SHORT_CONTEXT
    prompt = [(7 * i) % VOCAB for i in range(limit - 6)]
    req = [("long", prompt, SamplingParams(max_tokens=12, temperature=0))]
    outs, used = [], []
    for graphs in (False, True):
        engine = LLMEngine(model, config=EngineConfig(num_blocks=300, max_num_seqs=2, max_model_len=4096,
                                                      max_num_batched_tokens=4096))
        if graphs:
            runner = engine.runner
            runner.capture_cuda_graphs(2, 4096 // 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
            assert sorted(runner.graphs) == [1, 2]
            names = {LEAN_CONTEXT: "lean", SHORT_CONTEXT: "short", 4096: "any"}
            for size, plans in runner.graphs.items():
                assert [plan.max_context for plan in plans] == [4096, SHORT_CONTEXT, LEAN_CONTEXT]  # fp32: no MMA
                for plan, (g, logits, meta) in plans.items():
                    assert meta.max_context_len == plan.max_context
                    name = names[plan.max_context]
                    g.replay = (lambda g=g, name=name: (used.append(name), type(g).replay(g)))
        outs.append(run_all(engine, req)["long"].outputs[0].token_ids)
    assert outs[0] == outs[1]
    looser = {"lean": "short", "short": "any"}[bound]
    assert set(used) == {bound, looser} and used.index(looser) > len(used) - 1 - used[::-1].index(bound)


def test_graph_for_asks_the_plan():
    """The runner replays, of a size's graphs, the one whose plan has the tightest bound the step's longest context
    fits (`graph_plan_for`), the loosest past every bound; it reads no threshold itself."""
    from types import SimpleNamespace

    from brrr.engine.model_runner import ModelRunner
    from brrr.kernels.attention import decode_graph_plans

    plans = decode_graph_plans(1, 4096, 32, 8, 128, torch.bfloat16, 16, torch.device("cpu"))
    fake = SimpleNamespace(graphs={1: {plan: (f"graph {plan.max_context}", None, None) for plan in plans}})
    picked = [ModelRunner.graph_for(fake, 1, n)[0] for n in (7, 128, 129, 300, 2048, 3000, 5000)]
    assert picked == ["graph 128", "graph 128", "graph 256", "graph 2048", "graph 2048", "graph 4096", "graph 4096"]


def test_pipelining_with_a_queue_that_cannot_be_admitted(models):  # noqa: F811
    """More requests than max_num_seqs: while the batch is full the waiting ones cannot join, so decode stays
    pipelined; each is admitted once a place frees, and every token equals the step-by-step engine's."""
    _, model = models
    reqs = [(str(i), [(5 * i + j) % VOCAB for j in range(3 + i)], SamplingParams(max_tokens=4 + (i % 5), temperature=0))
            for i in range(9)]
    outs, pipelined = [], {"n": 0}
    for graphs in (False, True):
        engine = LLMEngine(model, config=EngineConfig(num_blocks=64, max_num_seqs=3, max_model_len=256))
        if graphs:
            runner = engine.runner
            runner.capture_cuda_graphs(3, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
            real = runner._replay

            def counting(batch, ids_from=None, real=real):
                pipelined["n"] += ids_from is not None and bool(engine.scheduler.waiting)
                return real(batch, ids_from)
            runner._replay = counting
        done = run_all(engine, reqs)
        outs.append({rid: out.outputs[0].token_ids for rid, out in done.items()})
    assert outs[0] == outs[1] and len(outs[0]) == 9
    assert pipelined["n"] > 3  # steps queued ahead while requests were waiting


def test_staged_inputs_are_aligned_as_their_own_allocations():
    """Every tensor of a staged step starts 16-byte aligned, whatever the sizes before it: Triton specializes kernels
    on pointer divisibility by 16, so a view at another offset would compile another variant mid-run."""
    import numpy as np

    from brrr.engine.staging import stage

    arrays = [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64), np.arange(7, dtype=np.int32).reshape(7, 1),
              np.arange(1, dtype=np.int64)]
    staged = stage(torch.device("cpu"), *arrays)
    for a, t in zip(arrays, staged):
        assert t.data_ptr() % 16 == 0
        assert t.shape == a.shape and t.tolist() == a.tolist()
