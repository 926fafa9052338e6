"""Multi-LoRA serving on CUDA: the grouped kernels against the reference at model shapes in bf16, inside a
captured CUDA graph whose input is the per-row slot index; and the engine (Triton kernels, packed projections, CUDA
graphs, pipelined decode) giving each request its adapter's merged-model greedy tokens in fp32."""
import copy

import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.kernels.lora import lora_apply, lora_apply_ref, lora_rows
from brrr.sampling_params import SamplingParams
from tests.lora.test_serving_engine import merged, prompts_for, random_adapter

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 7, 64, 300])
@pytest.mark.parametrize("fan_in,outs,rank", [(4096, (4096, 1024, 1024), 16), (4096, (14336, 14336), 16),
                                              (14336, (4096,), 16), (4096, (4096, 1024, 1024), 128)])
def test_kernels_match_reference_at_model_shapes(n, fan_in, outs, rank):
    g = torch.Generator(device="cuda").manual_seed(n)
    slots = 8
    x = torch.randn(n, fan_in, device="cuda", generator=g).bfloat16()
    a = (torch.randn(slots, len(outs) * rank, fan_in, device="cuda", generator=g) / fan_in**0.5).bfloat16()
    b = (torch.randn(slots, sum(outs), rank, device="cuda", generator=g) * 0.1).bfloat16()
    y = torch.randn(n, sum(outs), device="cuda", generator=g).bfloat16()
    row_slots = torch.randint(-1, slots, (n,), device="cuda", generator=g, dtype=torch.int32)
    offsets = tuple(int(v) for v in torch.tensor([0, *outs]).cumsum(0))
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    rows = lora_rows(row_slots, slots)
    got = lora_apply(y.clone(), x, a, b, rows, offsets, offsets_t)
    want = lora_apply_ref(y.clone(), x, a, b, rows, offsets)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(got[row_slots < 0], y[row_slots < 0])


def test_kernels_in_a_cuda_graph_follow_the_slot_input():
    slots, rank, n, fan_in, outs = 4, 16, 32, 512, (256, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, fan_in, device="cuda", generator=g).bfloat16()
    a = (torch.randn(slots, 2 * rank, fan_in, device="cuda", generator=g) / fan_in**0.5).bfloat16()
    b = torch.randn(slots, sum(outs), rank, device="cuda", generator=g).bfloat16()
    y0 = torch.randn(n, sum(outs), device="cuda", generator=g).bfloat16()
    y = y0.clone()
    offsets = (0, 256, 384)
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    row_slots = torch.full((n,), -1, dtype=torch.int32, device="cuda")

    def step():
        y.copy_(y0)
        lora_apply(y, x, a, b, lora_rows(row_slots, slots), offsets, offsets_t)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        row_slots.copy_(torch.randint(-1, slots, (n,), device="cuda", dtype=torch.int32,
                                      generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want = lora_apply_ref(y0.clone(), x, a, b, lora_rows(row_slots, slots), offsets)
        torch.testing.assert_close(y.float(), want.float(), atol=3e-2, rtol=2e-2)


def test_engine_mixed_adapters_on_cuda_match_merged_models(tmp_path):
    from brrr.engine import LoRARequest
    from brrr.lora import save_adapter
    from tests import hf_models

    torch.backends.cuda.matmul.allow_tf32 = False
    base = hf_models.build("llama3-rope")
    hf_models.save(base, tmp_path / "base")
    from brrr import load_model

    base = load_model(tmp_path / "base", dtype=torch.float32, device="cuda")
    adapters = []
    for i in range(3):
        adapter = random_adapter(base, 20 + i, r=4 * (i + 1))
        adapters.append((LoRARequest(f"a{i}", i + 1, str(save_adapter(tmp_path / f"a{i}", adapter))), adapter))
    prompts = prompts_for(12)
    loras = [None if i % 4 == 3 else adapters[i % 4][0] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(model, items, **config):
        engine = LLMEngine(model, None, EngineConfig(num_blocks=256, max_num_seqs=16, **config))
        for i, (p, lr) in enumerate(items):
            engine.add_request(str(i), p, params, lora_request=lr)
        out = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return engine, [out[str(i)] for i in range(len(items))]

    engine, got = run(copy.deepcopy(base), list(zip(prompts, loras)), enable_lora=True, max_loras=2,
                      max_lora_rank=16)
    assert engine.runner.graphs  # decode steps replayed captured graphs
    for lr, adapter in [(None, None)] + adapters:
        model = base if adapter is None else merged(base, adapter)
        mine = [i for i, x in enumerate(loras) if x == lr]
        _, want = run(copy.deepcopy(model), [(prompts[i], None) for i in mine])
        assert [got[i] for i in mine] == want
