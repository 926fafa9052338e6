"""The CUDA-graph decode path's inputs, checked on CPU: graphs are replaced by eager re-runs of the captured
step on the same static buffers, so padding, slot mapping, block tables and context lengths are exercised
exactly as a replay would see them."""
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine, SamplingParams
from tests.engine.test_engine import hf_greedy, models, run_all  # noqa: F401  (fixture)


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

    def counting(batch):
        replays["n"] += 1
        return real(batch)

    engine.runner._replay = counting
    done = run_all(engine, reqs)
    assert replays["n"] > 5  # most decode steps went through the graph path (batches of 5, 4, ... padded up)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, p, 12), f"request {i}"
