"""Guided decoding on CUDA with graphs: guided steps run pipelined (forward queued ahead, sampling after the
matchers advance) and every constrained sample stays valid; unguided neighbours keep their greedy tokens."""
import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.pretrained import load
from brrr.sampling_params import SamplingParams
from tests.engine.test_guided import CHOICES, REGEX, SCHEMA, check, guided

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipelined_guided_decode_on_cuda():
    pretrained = load(None, device="cuda")
    engine = LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(max_num_seqs=16, max_model_len=512),
                       pretrained.eos_token_ids)
    assert engine.runner.graphs, "the engine captured no CUDA graphs"
    ahead = {"n": 0}
    real = engine.runner.launch_forward

    def counting(batch, ids_from=None):
        ahead["n"] += 1
        return real(batch, ids_from)
    engine.runner.launch_forward = counting

    def run(requests):
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params, stream=False)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [done[str(i)] for i in range(len(requests))]

    plain = ("import os\n", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    (alone,) = run([plain])
    kinds = ["json", "regex", "choice"] * 4
    specs = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES}}
    outs = run([plain] + [("def main(", SamplingParams(seed=i, **guided(**specs[k]))) for i, k in enumerate(kinds)])
    assert ahead["n"] > 20
    assert outs[0].token_ids == alone.token_ids
    for kind, out in zip(kinds, outs[1:]):
        check(kind, out)
