"""Steady decoding never makes the host wait for the device, except once per step, on purpose: reading step t's
tokens (an event wait) after step t+1 is queued behind it. Counted with torch's sync debug mode, which raises on any
synchronizing CUDA call (a .item(), a blocking copy, a stream or device synchronize), and by counting event waits."""
import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.sampling_params import SamplingParams
from brrr.sampling_params import StructuredOutputsParams
from brrr.pretrained import load

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["plain", "guided"])
def test_a_steady_decode_step_waits_for_the_device_once(kind):
    pretrained = load(None, dtype="bfloat16", device="cuda")  # the shipped default model and its tokenizer
    engine = LLMEngine(pretrained.model, pretrained.tokenizer,
                       EngineConfig(num_blocks=256, max_num_seqs=8, cuda_graphs=True), pretrained.eos_token_ids)
    spec = StructuredOutputsParams(regex="a{300}") if kind == "guided" else None  # longer than the run
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True, structured_outputs=spec)
    for i in range(8):
        engine.add_request(str(i), f"def f{i}(x):", params)
    for _ in range(6):  # prefill, then decode until steps are queued ahead
        engine.step()
    waits = {"n": 0}
    real = torch.cuda.Event.synchronize

    def counting(self):
        waits["n"] += 1
        return real(self)

    torch.cuda.Event.synchronize = counting
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = 0
        for _ in range(20):
            assert engine.step()
            queued += engine.core._queued is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = real
    assert queued == 20  # every step had the next one queued behind it
    assert waits["n"] == 20  # one event wait a step: its tokens
