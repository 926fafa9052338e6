"""The prefix cache's host tier (`--kv-offloading-size`, brrr/engine/host_prefix.py): blocks the device pool evicts
are copied to host memory and come back on a prefix hit; the tokens are those of an engine without any cache, and
no device or host block leaks (tiny llama, fp32 weights, CPU)."""
import argparse
import random

import pytest

from brrr.config import EngineConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.engine import LLMEngine
from brrr.engine.host_prefix import HostPrefixTier
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams
from tests.engine.test_graph_inputs import EagerReplay
from tests.engine.test_swap import VOCAB, model, step_all  # noqa: F401 (model: the swap tests' fixture)
from tests.engine.test_swap import swap_gib as gib


def run(engine, requests):
    """Add the requests, step to the end (checking the pools every step); {request id: token ids of output 0}."""
    def pools_whole(e):
        e.block_manager.check_invariants(list(e.scheduler.waiting) + e.scheduler.running)
    return {rid: out.outputs[0].token_ids for rid, out in step_all(engine, requests, pools_whole).items()}


def test_an_evicted_prefix_comes_back_from_the_host(model):
    """A prompt's blocks are pushed out of a 12-block pool by later prompts; asked again, its 4 full blocks are
    copied back from the host (64 tokens of host hits, not recomputed) and its tokens are the first run's."""
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(80)]
    params = SamplingParams(max_tokens=8, temperature=0)
    engine = LLMEngine(model, config=EngineConfig(num_blocks=12, block_size=16, max_num_batched_tokens=64,
                                                  max_num_seqs=2, kv_offloading_size=gib(model, 64)))
    first = run(engine, [("a", prompt, params)])["a"]
    for i in range(3):  # each fills most of the pool: every cached block of `prompt` is evicted
        run(engine, [(f"other{i}", [rng.randrange(VOCAB) for _ in range(150)], params)])
    assert engine.block_manager.hash_to_block.keys().isdisjoint(
        h for h in engine.block_manager.host_tier.entries)  # on the host only
    prompt_tokens = engine.stats()["prompt_tokens"]
    again = run(engine, [("a-again", prompt, params)])["a-again"]
    assert again == first
    stats = engine.stats()
    assert stats["host_prefix_cache_hits"] == 64
    assert stats["prompt_tokens"] - prompt_tokens == 16  # prefilled: the one block the tier did not hold
    assert engine.block_manager.host_tier.loaded == 4


@pytest.mark.parametrize("tier_blocks", [3, 40])
def test_shared_prefixes_under_pressure_give_the_tokens_of_no_cache(model, tier_blocks):
    """Many requests over a few shared prefixes, a pool that evicts and preempts, and a host tier small enough to
    evict its own entries in the steps that load others (3 blocks) or large enough to hold everything: the greedy
    tokens equal an engine without prefix caching."""
    rng = random.Random(6)
    bases = [[rng.randrange(VOCAB) for _ in range(rng.choice([32, 48, 64]))] for _ in range(4)]
    requests = []
    for i in range(16):
        prompt = rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        requests.append((str(i), prompt, SamplingParams(max_tokens=rng.randint(4, 16), temperature=0)))
    want = run(LLMEngine(model, config=EngineConfig(num_blocks=200, enable_prefix_caching=False)), requests)
    engine = LLMEngine(model, config=EngineConfig(num_blocks=14, block_size=16, max_num_batched_tokens=48,
                                                  max_num_seqs=3, kv_offloading_size=gib(model, tier_blocks)))
    # graphs (eager stand-ins on CPU): decode steps are planned ahead, and the blocks they take may spill too
    engine.runner.capture_cuda_graphs(3, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
    ahead_spills, plan_ahead = [], engine.scheduler.schedule_next_decode

    def counting(batch):
        nxt = plan_ahead(batch)
        ahead_spills.append(0 if nxt is None else len(nxt.swap_out))
        return nxt

    engine.scheduler.schedule_next_decode = counting
    got = {}
    for chunk in range(0, 16, 4):  # in waves, so later waves find earlier prefixes evicted to the host
        got.update(run(engine, requests[chunk:chunk + 4]))
    assert got == want
    assert any(ahead_spills), "no step planned ahead evicted a cached block"
    tier = engine.block_manager.host_tier
    assert engine.stats()["host_prefix_cache_hits"] > 0 and tier.loaded > 0
    assert tier.stored > tier.num_blocks or tier_blocks == 40  # the small tier evicted its own entries
    tier.check_invariants()


def test_the_tier_keeps_pinned_entries_and_evicts_the_least_recent():
    tier = HostPrefixTier(first=10, num_blocks=2)
    assert tier.store(1, (1,)) == 10 and tier.store(2, (2,)) == 11
    assert tier.store(1, (1,)) is None  # held already: no copy
    assert tier.lookup(2, (2,)) == 11 and tier.lookup(2, (9,)) is None  # tokens must match too
    assert tier.store(3, (3,)) == 10  # 2 is pinned (a copy in is queued), so 1 goes though it is more recent
    assert tier.lookup(3, (3,)) == 10
    assert tier.store(4, (4,)) is None  # every entry pinned: the block is dropped, not copied
    tier.unpin_all()
    assert tier.store(4, (4,)) == 11 and set(tier.entries) == {3, 4}  # 2, the least recently used, goes
    tier.check_invariants()
    tier.clear()
    assert not tier.entries and tier.store(5, (5,)) == 10


def test_reset_prefix_cache_forgets_the_host_copies(model):
    engine = LLMEngine(model, config=EngineConfig(num_blocks=12, kv_offloading_size=gib(model, 8)))
    rng = random.Random(1)
    run(engine, [(str(i), [rng.randrange(VOCAB) for _ in range(100)], SamplingParams(max_tokens=2, temperature=0))
                 for i in range(3)])
    assert engine.block_manager.host_tier.entries
    engine.block_manager.reset_prefix_cache()
    assert not engine.block_manager.host_tier.entries


def test_the_flag_and_the_config_checks_name_the_field():
    parser = argparse.ArgumentParser()
    add_kv_cache_args(parser)
    assert EngineConfig(**kv_cache_config(parser.parse_args(["--kv-offloading-size", "2"]))).kv_offloading_size == 2
    with pytest.raises(BrrrError, match=r"kv_offloading_size \(--kv-offloading-size\) must be a number of GiB >= 0"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(BrrrError, match="kv_offloading_size keeps evicted prefix-cache blocks.*enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(BrrrError, match="kv_offloading_size does not combine with speculative_config"):
        EngineConfig(kv_offloading_size=1, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_size_under_one_block_is_refused(model):
    with pytest.raises(BrrrError, match="kv_offloading_size .* holds no KV block"):
        LLMEngine(model, config=EngineConfig(num_blocks=12, kv_offloading_size=gib(model, 0.5)))
