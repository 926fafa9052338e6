"""Many adapters in one batch through the engine: each request's greedy tokens equal those of its adapter alone,
merged into a copy of the base (W + scaling * B @ A) and run without LoRA, under stress (a tiny KV pool that forces
preemption, a token budget that forces chunked prefill, shared prefixes that hit the prefix cache, fewer slots than
adapters); the prefix cache never crosses adapters; everything is free afterwards; bad adapters are named."""
import copy

import pytest
import torch

from brrr import BrrrError, SamplingParams
from brrr.config import EngineConfig
from brrr.engine import LLMEngine, LoRARequest
from brrr.lora import LoraAdapter, LoraConfig, save_adapter
from brrr.pretrained import load
from tests import hf_models

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-base")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope"), path)
    return path


@pytest.fixture(scope="module")
def base(base_dir):
    return load(str(base_dir), dtype="float32", device="cpu").model


def random_adapter(model, seed, r=4, targets=MODULES, alpha=8.0, scale=0.3) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            weights[name] = (torch.randn(r, m.in_features, generator=g) * scale,
                             torch.randn(m.out_features, r, generator=g) * scale)
    return LoraAdapter(LoraConfig(r=r, lora_alpha=alpha, target_modules=tuple(targets)), weights)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """4 adapters of different ranks and targets, saved in PEFT's format: (LoRARequest, LoraAdapter)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [dict(r=4), dict(r=8, targets=("q_proj", "v_proj")), dict(r=2, targets=("gate_proj", "up_proj",
             "down_proj")), dict(r=16, alpha=4.0)]
    out = []
    for i, spec in enumerate(specs):
        adapter = random_adapter(base, 10 + i, **spec)
        path = save_adapter(root / f"a{i}", adapter)
        out.append((LoRARequest(f"a{i}", i + 1, str(path)), adapter))
    return out


def merged(model, adapter: LoraAdapter):
    m = copy.deepcopy(model)
    modules = dict(m.named_modules())
    with torch.no_grad():
        for name in adapter.weights:
            modules[name].weight += adapter.delta(name).to(modules[name].weight)
    return m


def greedy(model, prompts, max_tokens, **config):
    engine = LLMEngine(model, None, EngineConfig(**{"num_blocks": 64, **config}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, stream=False)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return [outs[str(i)] for i in range(len(prompts))]


def prompts_for(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (20,), generator=g).tolist()  # a common prefix: prefix-cache hits
    return [shared + torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_mixed_adapters_match_merged_models_under_stress(base, adapters):
    prompts = prompts_for(15)
    loras = [None if i % 5 == 4 else adapters[i % 5][0] for i in range(len(prompts))]  # 4 adapters and the base
    max_tokens = 12
    want = {}
    for lr, adapter in [(None, None)] + adapters:
        model = base if adapter is None else merged(base, adapter)
        mine = [i for i, x in enumerate(loras) if x == lr]
        for i, tokens in zip(mine, greedy(model, [prompts[i] for i in mine], max_tokens)):
            want[i] = tokens
    # 2 slots for 4 adapters, 10 KV blocks of 8 for 15 requests of ~40 tokens, 24 tokens a step
    engine = LLMEngine(copy.deepcopy(base), None, EngineConfig(
        num_blocks=12, block_size=8, max_num_batched_tokens=24, enable_lora=True, max_loras=2, max_lora_rank=16,
        max_cpu_loras=2))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, (p, lr) in enumerate(zip(prompts, loras)):
        engine.add_request(str(i), p, params, stream=False, lora_request=lr)
    got, adapters_per_step = {}, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[int(o.request_id)] = o.outputs[0].token_ids
        adapters_per_step.append(len(engine.scheduler.running_adapters()))
    assert got == want
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert max(adapters_per_step) <= 2 and engine.lora.loads > 4  # slots were reused (LRU)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.running_adapters()
    engine.block_manager.check_invariants([])


def test_adapters_change_the_output(base, adapters):
    """The oracle above is not vacuous: each adapter's greedy tokens differ from the base model's."""
    prompts = prompts_for(3, seed=1)
    plain = greedy(base, prompts, 8)
    for _, adapter in adapters:
        assert greedy(merged(base, adapter), prompts, 8) != plain
