"""FP8 KV cache through the engine (tiny llama, fp32 weights, CPU): agreement with the fp32 cache, exactness of the
fp8 engine under preemption, chunking, prefix hits and aborts against the same fp8 engine with nothing constrained,
scales that stay fixed once computed, speculative decoding and LoRA unchanged, and the block count a memory budget
buys.

Stated rates (teacher-forced over 3 x 160 prompt positions: prompt_logprobs, whose keys are all read back from the
cache): e4m3 picks the fp32 cache's top token at >= 90% of positions (measured 94.7%), mean |logprob difference|
< 0.05 nats (0.024), max < 0.3 (0.17); e5m2 >= 80% (87.7%), mean < 0.08 (0.048), max < 0.4 (0.23). A random tiny
model's next-token distribution is nearly flat, so near-ties flip more often than a trained model's would.
"""
import random

import pytest
import torch

from brrr import load_model
from brrr.analysis.hardware import get_gpu
from brrr.analysis.serve import serve_plan
from brrr.config import EngineConfig
from brrr.engine import LLMEngine, LoRARequest
from brrr.engine.model_runner import kv_bytes_per_block
from brrr.errors import BrrrError
from brrr.lora import save_adapter
from brrr.sampling_params import SamplingParams
from tests import hf_models
from tests.engine.test_engine import run_all
from tests.lora.test_serving_engine import merged, random_adapter

VOCAB = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-model")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=512, num_key_value_heads=2), path)
    return load_model(path, dtype=torch.float32)


def prompt_scores(model, prompts, **kw):
    """(logprob of each prompt token, top token at each position) from prompt_logprobs."""
    engine = LLMEngine(model, config=EngineConfig(num_blocks=128, **kw))
    done = run_all(engine, [(str(i), p, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
                            for i, p in enumerate(prompts)])
    lps = [done[str(i)].prompt_logprobs[1:] for i in range(len(prompts))]
    return (torch.tensor([[d[p[j + 1]] for j, d in enumerate(lp)] for p, lp in zip(prompts, lps)]),
            torch.tensor([[max(d, key=d.get) for d in lp] for lp in lps]))


@pytest.mark.parametrize("dtype, rate, mean, most", [("fp8", 0.90, 0.05, 0.3), ("fp8_e5m2", 0.80, 0.08, 0.4)])
def test_fp8_agrees_with_the_fp32_cache_within_the_stated_rate(model, dtype, rate, mean, most):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(161)] for _ in range(3)]
    ref_lp, ref_top = prompt_scores(model, prompts)
    lp, top = prompt_scores(model, prompts, kv_cache_dtype=dtype)
    diff = (lp - ref_lp).abs()
    assert (top == ref_top).float().mean() >= rate
    assert 0 < diff.mean() < mean and diff.max() < most


def test_fp8_engine_is_exact_under_preemption_chunking_prefix_hits_and_aborts(model):
    """The engine stress test's workload (fewer requests) with kv_cache_dtype='fp8': every request gets the tokens
    the fp8 engine gives it with room for everything (no preemption, no chunking, no prefix cache): quantization
    is per value with a fixed scale, so no batch can change what a token's keys read back as."""
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(120)]
    prompts = [((shared[: rng.randint(16, 120)] if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in
                range(rng.randint(1, 200))]) for i in range(24)]
    lengths = [rng.randint(8, 40) for _ in prompts]
    reqs = [(str(i), p, SamplingParams(max_tokens=n, temperature=0)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    roomy = LLMEngine(model, config=EngineConfig(num_blocks=600, max_num_batched_tokens=8192,
                                                 enable_prefix_caching=False, kv_cache_dtype="fp8"))
    want = run_all(roomy, reqs)
    tight = LLMEngine(model, config=EngineConfig(num_blocks=24, block_size=16, max_num_batched_tokens=64,
                                                 max_num_seqs=16, kv_cache_dtype="fp8"))
    aborted = {"5": 4, "11": 9}
    got = run_all(tight, reqs, abort_at=aborted)  # (run_all checks the block manager's invariants at the end)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    for rid, out in got.items():
        if rid in aborted and out.outputs[0].finish_reason == "abort":
            continue
        assert out.outputs[0].token_ids == want[rid].outputs[0].token_ids, f"request {rid}"
    assert set(want) - set(got) <= set(aborted)


def test_calculated_scales_are_set_once_and_survive_preemption_and_prefix_hits(model):
    engine = LLMEngine(model, config=EngineConfig(num_blocks=16, block_size=16, max_num_batched_tokens=64,
                                                  max_num_seqs=8, kv_cache_dtype="fp8", calculate_kv_scales=True))
    caches = engine.runner.kv_caches
    assert all(pair.pending for pair in caches)
    rng = random.Random(1)
    shared = [rng.randrange(VOCAB) for _ in range(64)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 90))] for _ in range(8)]
    reqs = [(str(i), p, SamplingParams(max_tokens=48, temperature=0)) for i, p in enumerate(prompts)]
    first = run_all(engine, reqs[:1])  # the first prefill sets every layer's scales
    scales = [tuple(s.item() for s in pair.scales) for pair in caches]
    assert not any(pair.pending for pair in caches)
    assert all(0 < s < 0.1 for pair in scales for s in pair)  # amax / 448 of this model's K and V (|x| ~ 3), not 1.0
    again = run_all(engine, reqs)  # 8 sequences of up to ~200 tokens on 16 blocks: preemptions, recomputes
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["prefix_cache_hits"] > 0
    assert [tuple(s.item() for s in pair.scales) for pair in caches] == scales
    # request 0 again, now among others, preempted and over prefix hits: the same keys, the same tokens
    assert again["0"].outputs[0].token_ids == first["0"].outputs[0].token_ids


def test_fp8_with_speculative_decoding_gives_the_same_greedy_tokens(model):
    rng = random.Random(2)
    motif = [rng.randrange(VOCAB) for _ in range(12)]
    prompts = [motif * 4 + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(3)]
    reqs = [(str(i), p, SamplingParams(max_tokens=16, temperature=0)) for i, p in enumerate(prompts)]
    plain = run_all(LLMEngine(model, config=EngineConfig(num_blocks=64, kv_cache_dtype="fp8")), reqs)
    spec = LLMEngine(model, config=EngineConfig(num_blocks=64, kv_cache_dtype="fp8", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4}))
    got = run_all(spec, reqs)
    assert spec.spec.num_accepted_tokens > 0
    for rid in plain:
        assert got[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids


def test_fp8_doubles_the_blocks_of_a_memory_budget_and_matches_calc(model):
    cfg = model.config
    bf16 = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn) * 2 == bf16
    assert kv_bytes_per_block(cfg, 16, torch.float8_e5m2) * 4 == kv_bytes_per_block(cfg, 16, torch.float32)
    budget = 1 << 20
    blocks = {dt: LLMEngine(model, config=EngineConfig(kv_cache_memory=budget, max_num_seqs=64,
                                                       kv_cache_dtype=dt)).block_manager.num_blocks
              for dt in ("auto", "fp8")}
    assert blocks["fp8"] == budget // kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn) == 4 * blocks["auto"]
    plan = serve_plan(cfg, get_gpu("h200"), kv_dtype="fp8", context=256, prompt=16, batches=(1,))
    assert plan["kv_bytes_per_token_per_gpu"] * 16 == kv_bytes_per_block(cfg, 16, torch.float8_e4m3fn)


@pytest.mark.parametrize("bad, message", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales needs an fp8 kv_cache_dtype"),
])
def test_bad_kv_cache_dtype_names_the_field(bad, message):
    with pytest.raises(BrrrError, match=message):
        EngineConfig(**bad)


def test_fp8_with_lora_equals_the_merged_model_on_fp8(model, tmp_path):
    """A LoRA request (adapter on every projection, k and v included) over an fp8 cache gives the tokens of its
    adapter merged into the weights, over an fp8 cache too: the cache quantizes whatever K and V the layers make."""
    adapter = random_adapter(model, 5)
    request = LoRARequest("a", 1, str(save_adapter(tmp_path / "a", adapter)))
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = run_all(LLMEngine(merged(model, adapter), config=EngineConfig(num_blocks=64, kv_cache_dtype="fp8")),
                   [(str(i), p, params) for i, p in enumerate(prompts)])
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, kv_cache_dtype="fp8", enable_lora=True,
                                                  max_lora_rank=4))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, lora_request=request)
    got = run_all(engine, [])
    assert [got[str(i)].outputs[0].token_ids for i in range(4)] == [want[str(i)].outputs[0].token_ids
                                                                     for i in range(4)]
