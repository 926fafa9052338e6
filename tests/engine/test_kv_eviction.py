"""StreamingLLM eviction (window attention with sinks at original positions) through the engine, tiny llama on CPU:
a 4,096-token generation on a 512-token budget holds at most the budget's blocks and equals a plain-torch loop over
the model with a contiguous cache that keeps the same positions; preemption (recompute past the budget, one block a
step), aborts and n > 1 leak no block and keep the tokens; an evicting sequence's later blocks are never prefix hits.

(Checked by hand too: transformers' LlamaForCausalLM stepping with a 4D mask of the same kept positions predicts
every one of the 4,096 tokens; 55 s on 2 CPU cores, too slow for CI, so the contiguous-cache loop stands in.)
"""
import random

import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.attention.kv_quant import QuantKV, as_bytes
from brrr.sampling_params import SamplingParams
from tests import hf_models
from tests.engine.test_engine import run_all

VOCAB, BS = 256, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("evict-model")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=4400, num_key_value_heads=2), path)
    return load_model(path, dtype=torch.float32)


def evicting(model, budget, num_blocks=64, sink=4, **kw):
    return LLMEngine(model, config=EngineConfig(num_blocks=num_blocks, block_size=BS, kv_eviction="streaming",
                                                kv_budget=budget, kv_sink_tokens=sink, **kw))


@torch.no_grad()
def streaming_reference(model, prompt, new_tokens, budget, sink_tokens, kv_dtype=None):
    """Greedy tokens and their logprobs from the model stepping over one contiguous cache per layer that holds the
    kept tokens in order: the prompt prefilled at once (it fits the budget), then, before each new position p, the
    positions whose block is neither a sink block nor among the last `window` blocks up to p's own are cut out and
    the rest moved down. Positions are the original ones. kv_dtype: an fp8 cache (scales 1.0), as the engine's."""
    cfg = model.config
    sink, window = -(-sink_tokens // BS), budget // BS - -(-sink_tokens // BS)
    shape = (1, budget, cfg.num_kv_heads, cfg.head_dim)
    pair = (lambda k, v: (k, v)) if kv_dtype is None else QuantKV
    caches = [pair(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
              for _ in range(cfg.num_layers)]
    kept = list(range(len(prompt)))  # original position of each cache slot
    n = len(prompt)
    meta = AttnMeta(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seqlens_q=[n], context_lens=[n],
                    slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                    kv_caches=caches)
    logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta)[-1:])
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        lp = logits[0].log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(lp[token].item())
        p = len(prompt) + len(tokens) - 1  # the new token's position
        first = max(sink, p // BS - window + 1)
        keep = [i for i, q in enumerate(kept) if q // BS < sink or q // BS >= first]
        if len(keep) < len(kept):
            index = torch.tensor(keep)
            for k, v in caches:
                for c in (as_bytes(k), as_bytes(v)):  # (fp8 as bytes: CPU indexing has no fp8 kernels)
                    c[0, :len(keep)] = c[0, index].clone()
            kept = [kept[i] for i in keep]
        slot = len(kept)
        kept.append(p)
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seqlens_q=[1], context_lens=[slot + 1],
                        slot_mapping=torch.tensor([slot]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        kv_caches=caches)
        logits = model.compute_logits(model(torch.tensor([token]), torch.tensor([p]), meta))
    return tokens, logprobs


def test_4096_tokens_on_a_512_token_budget_stay_in_budget_and_equal_the_reference(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    engine = evicting(model, 512)
    engine.add_request("long", prompt, SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True, logprobs=0))
    most, out, bm = 0, None, engine.block_manager
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            most = max(most, len(seq.block_table))
            assert len(seq.block_table) * BS <= 512
    assert most == 512 // BS  # the budget is used, and never passed
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    got = out.outputs[0]
    assert len(got.token_ids) == 4096
    want, want_lp = streaming_reference(model, prompt, 4096, 512, 4)
    assert got.token_ids == want
    assert max(abs(e[t] - w) for e, t, w in zip(got.logprobs, got.token_ids, want_lp)) < 1e-4


def test_eviction_over_an_fp8_cache_equals_the_reference_over_one(model):
    prompt = [7, 7, 2, 9, 4]
    got = run_all(evicting(model, 64, kv_cache_dtype="fp8"),
                  [("a", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))])["a"]
    want, _ = streaming_reference(model, prompt, 400, 64, 4, torch.float8_e4m3fn)
    assert got.outputs[0].token_ids == want


def test_preemption_aborts_and_forks_leak_nothing_and_keep_the_tokens(model):
    """Four sequences of 300 tokens on a 128-token budget in a pool of 20 blocks (they want 32): preempted ones are
    recomputed past the budget one block a step and give the tokens they give alone; aborts and n = 2 forks free
    every block (check_invariants after every step)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(5)]
    params = [SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, n=2 if i == 4 else 1)
              for i in range(5)]
    alone = {}
    for i in (0, 1, 2, 4):
        alone[str(i)] = run_all(evicting(model, 128), [(str(i), prompts[i], params[i])])[str(i)]
    engine = evicting(model, 128, num_blocks=20)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done, step, sched = {}, 0, engine.scheduler
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
        if step == 40:
            engine.abort("3")
        seqs = sched.running + list(sched.waiting)
        engine.block_manager.check_invariants(seqs)
        assert all(len(s.block_table) <= 128 // BS for s in seqs)
    assert sched.num_preemptions > 0
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for rid, want in alone.items():
        assert [c.token_ids for c in done[rid].outputs] == [c.token_ids for c in want.outputs], f"request {rid}"


def test_an_evicting_sequence_shares_only_what_it_computed_before_evicting(model):
    engine = evicting(model, 128)
    prompt = list(range(40))
    first = run_all(engine, [("a", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))])["a"]
    whole = prompt + first.outputs[0].token_ids
    bm = engine.block_manager
    # hashed: only the blocks filled before the first eviction (the first budget's worth)
    assert 0 < len(bm.hash_to_block) <= 128 // BS
    second = run_all(engine, [("b", whole[:220], SamplingParams(max_tokens=1, temperature=0))])["b"]
    assert 0 < second.metrics.num_cached_tokens <= 128


@pytest.mark.parametrize("bad, message", [
    (dict(kv_eviction="lru", kv_budget=128), "kv_eviction must be one of streaming, snapkv, h2o"),
    (dict(kv_eviction="streaming"), "kv_budget must be an integer >= 48"),
    (dict(kv_eviction="streaming", kv_budget=100), "must be a multiple of block_size"),
    (dict(kv_budget=128), "kv_budget is set but kv_eviction is None"),
    (dict(kv_eviction="streaming", kv_budget=128, speculative_config={"method": "ngram",
                                                                       "num_speculative_tokens": 2}),
     "does not combine with speculative_config"),
])
def test_bad_eviction_settings_name_the_field(bad, message):
    with pytest.raises(BrrrError, match=message):
        EngineConfig(block_size=BS, **bad)
