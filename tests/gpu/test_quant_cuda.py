"""Quantized checkpoints of the default model served by the engine on CUDA (reference ops, CUDA graphs on): greedy
tokens equal the contiguous-cache reference generation of the same quantized model. Written on a CPU-only session
(not yet run on a GPU): the next GPU session runs it first."""
import random

import pytest
import torch

import brrr
from brrr import load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine, SamplingParams
from brrr.generate import generate_tokens
from brrr.kernels.dispatch import use_reference
from brrr.quant.checkpoint import save_quantized
from brrr.quant.methods import quantize_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["rtn-int8", "rtn-int4", "nf4", "fp8"])
def test_quantized_default_model_engine_matches_reference_generation(tmp_path, method):
    torch.backends.cuda.matmul.allow_tf32 = False
    pre = brrr.load(dtype="float32", device="cpu")
    save_quantized(pre.model, quantize_model(pre.model, method), tmp_path, pre.path)
    with use_reference():
        model = load_model(tmp_path, dtype=torch.float32, device="cuda")
        engine = LLMEngine(model, config=EngineConfig(gpu_memory_utilization=0.02, max_num_batched_tokens=128))
        rng = random.Random(0)
        prompts = [[rng.randrange(8192) for _ in range(rng.randint(1, 100))] for _ in range(8)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for i, p in enumerate(prompts):
            with torch.no_grad():
                want = list(generate_tokens(model, p, params))
            assert list(done[str(i)].outputs[0].token_ids) == want
