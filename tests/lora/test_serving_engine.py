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


@pytest.mark.parametrize("packed", [False, True])  # packed: q/k/v and gate/up as one projection of 3 and 2 slices
def test_mixed_adapters_match_merged_models_under_stress(base, adapters, packed):
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
        max_cpu_loras=2, pack_projections=packed))
    assert any(type(m).__name__ == "PackedAttention" for m in engine.model.modules()) == packed
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, (p, lr) in enumerate(zip(prompts, loras)):
        engine.add_request(str(i), p, params, stream=False, lora_request=lr)
    got, adapters_per_step = {}, []
    engine.schedule_log = []  # each step's (computed, new) per sequence
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[int(o.request_id)] = o.outputs[0].token_ids
        adapters_per_step.append(len(engine.scheduler.running_adapters()))
    assert got == want
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert any(done > 0 and new > 1 for step in engine.schedule_log for done, new in step)  # a prefill in chunks
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


def _engine(base, **config):
    return LLMEngine(copy.deepcopy(base), None, EngineConfig(**{"num_blocks": 64, "block_size": 8, "enable_lora": True,
                                                                "max_loras": 2, **config}))


def _run(engine, items, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"r{engine.num_steps}-{i}", p, params, lora_request=lr) for i, (p, lr) in
            enumerate(items)]
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return reqs, [out[r.request_id] for r in reqs]


def test_prefix_cache_is_keyed_by_adapter(base, adapters):
    engine = _engine(base)
    (a, _), (b, _) = adapters[:2]
    prompt = prompts_for(1, seed=5)[0]  # 20 + tokens: two full blocks of 8 to share
    first, _ = _run(engine, [(prompt, a)])
    assert first[0].num_cached_tokens == 0
    other, _ = _run(engine, [(prompt, b)])
    plain, _ = _run(engine, [(prompt, None)])
    assert other[0].num_cached_tokens == 0 and plain[0].num_cached_tokens == 0  # no hit across adapters or the base
    same, _ = _run(engine, [(prompt, a)])
    assert same[0].num_cached_tokens >= 16  # the same adapter hits


def test_remove_and_abort_while_running_free_everything(base, adapters):
    """An adapter removed while one request runs on it and another waits: both finish on it (the waiting one reads
    it again from its path); aborted requests free their blocks and their adapter's slot."""
    (a, adapter), (b, _) = adapters[0], adapters[1]
    prompts = prompts_for(3, seed=7)
    want = greedy(merged(base, adapter), prompts[:2], 6)
    engine = _engine(base, max_num_seqs=1)  # one runs, one waits
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add_request(str(i), prompts[i], params, lora_request=a)
    engine.step()
    assert engine.remove_lora(a.lora_int_id) and a.lora_int_id not in engine.list_loras()
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [out["0"], out["1"]] == want
    engine.add_request("x", prompts[2], SamplingParams(max_tokens=50, ignore_eos=True), lora_request=b)
    engine.step()
    assert engine.scheduler.running_adapters() == {b.lora_int_id}
    engine.abort("x")
    assert not engine.scheduler.running_adapters() and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_adapters_are_named(base, adapters, tmp_path):
    engine = _engine(base, max_lora_rank=8)
    other = random_adapter(hf_models.build("llama3-rope", hidden_size=96), 3)
    with pytest.raises(BrrrError, match="another base model"):
        engine.add_lora(LoRARequest("other", 9, str(save_adapter(tmp_path / "other", other))))
    with pytest.raises(BrrrError, match=r"r=16 is above --max-lora-rank=8"):
        engine.add_lora(adapters[3][0])
    with pytest.raises(BrrrError, match=r"max_cpu_loras \(2\) must be >= max_loras \(4\)"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(BrrrError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(tmp_path))
    with pytest.raises(BrrrError, match="enable_lora=True"):
        LLMEngine(copy.deepcopy(base), None, EngineConfig(num_blocks=8)).add_request("q", [1, 2], None,
                                                                                     lora_request=adapters[0][0])
    dora = random_adapter(base, 4)
    dora = LoraAdapter(LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, use_dora=True), dora.weights)
    with pytest.raises(BrrrError, match="DoRA"):
        engine.add_lora(LoRARequest("dora", 10, str(save_adapter(tmp_path / "dora", dora))))
    assert not engine.has_unfinished_requests() and engine.list_loras() == set()


@pytest.mark.parametrize("method", ["rtn-int8", "rtn-int4"])
def test_adapters_over_a_quantized_base(base, adapters, method):
    """W8A16 / W4A16 bases (packed QuantLinears): each request gets dequant(W) x + its adapter's update, i.e. the
    greedy tokens of dequant(W) + scaling * B @ A in floating point."""
    from brrr.quant.linear import QuantLinear
    from brrr.quant.methods import quantize_model

    quantized = copy.deepcopy(base)
    quantize_model(quantized, method, group_size=32)
    dense = copy.deepcopy(quantized)
    for name, m in list(dense.named_modules()):
        if isinstance(m, QuantLinear):
            linear = torch.nn.Linear(m.in_features, m.out_features, bias=False)
            linear.weight.data = m.dequantize().float()
            parent, _, child = name.rpartition(".")
            setattr(dense.get_submodule(parent), child, linear)
    prompts = prompts_for(4, seed=9)
    (a, adapter), (b, _) = adapters[0], adapters[1]
    loras = [a, None, a, b]
    engine = LLMEngine(quantized, None, EngineConfig(num_blocks=64, enable_lora=True, max_loras=2,
                                                     pack_projections=True))
    assert any(type(m).__name__ == "QuantLinear" for m in engine.model.modules())
    _, got = _run(engine, list(zip(prompts, loras)), max_tokens=6)
    want_a = greedy(merged(dense, adapter), [prompts[0], prompts[2]], 6)
    assert [got[0], got[2]] == want_a
    assert got[1] == greedy(dense, [prompts[1]], 6)[0]
    assert got[3] == greedy(merged(dense, adapters[1][1]), [prompts[3]], 6)[0]


def test_a_request_waiting_for_a_slot_is_not_overtaken_by_adapter_requests(base, adapters):
    """One slot: B waits while A runs; a later A request waits behind B (else a stream of A requests could keep B
    out forever), while a base-model request behind B goes ahead."""
    (a, _), (b, _) = adapters[0], adapters[1]
    engine = _engine(base, max_loras=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    p = prompts_for(4, seed=11)
    reqs = [engine.add_request(name, prompt, params, lora_request=lr)
            for name, prompt, lr in zip(["a1", "b1", "a2", "base"], p, [a, b, a, None])]
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r.request_id for r in reqs if r.first_scheduled_time is not None and r.request_id not in order]
    assert order.index("a1") < order.index("b1") < order.index("a2")
    assert order.index("base") < order.index("b1")


def test_lora_rows_are_a_feature_only_of_engines_serving_adapters(base, adapters):
    """Without enable_lora the LoRA rows feature is not built and the runner has no row input; with it, the feature
    is in a step only while a live request names an adapter, and then gives each item its slot (-1: base)."""
    plain = LLMEngine(copy.deepcopy(base), None, EngineConfig(num_blocks=16))
    assert [f.name for f in plain.features] == ["forks", "prompt_logprobs", "guided"]
    assert plain.lora is None and plain.runner.row_input is None
    engine = LLMEngine(copy.deepcopy(base), None, EngineConfig(num_blocks=16, enable_lora=True, max_loras=2,
                                                               max_lora_rank=16))
    rows = engine.feature("lora")
    assert [f.name for f in engine.features] == ["forks", "prompt_logprobs", "guided", "lora"]
    assert engine.runner.row_input is rows.row_input and engine.lora is rows.manager
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("base", [1, 2, 3], params)
    assert rows not in engine._on  # base-model requests only: the step runs none of its code
    engine.add_request("a", [4, 5, 6, 7], params, lora_request=adapters[0][0])
    assert rows in engine._on
    plan = engine.core._make_plan(engine.scheduler.schedule())
    assert plan.batch.row_values.tolist() == [-1, engine.lora.slot_of[adapters[0][0].lora_int_id]]
    engine.step(plan.batch)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("base again", [1, 2], params)
    engine.step()
    assert rows not in engine._on
