"""Swap preemption: the flags and EngineConfig fields that turn it on, and the engine with a KV cache small enough to
preempt (tiny llama, fp32 weights, CPU): the tokens of no preemption, a host pool that never leaks."""
import argparse
import random

import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.engine import LLMEngine
from brrr.engine.model_runner import kv_bytes_per_block
from brrr.engine.swap import HostBlockPool, block_runs, host_runs, swap_policy
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams
from tests import hf_models


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_kv_cache_args(parser)
    return parser.parse_args(list(argv))


def test_the_flags_reach_the_engine_config():
    args = parse("--swap-space", "1.5", "--preemption-mode", "swap")
    config = EngineConfig(**kv_cache_config(args))
    assert (config.swap_space, config.preemption_mode) == (1.5, "swap")
    off = EngineConfig(**kv_cache_config(parse()))
    assert (off.swap_space, off.preemption_mode) == (0.0, None)


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "lots"])
def test_a_negative_or_unreadable_swap_space_names_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse("--swap-space", value)
    assert "--swap-space" in capsys.readouterr().err


def test_engine_config_checks_name_the_field():
    with pytest.raises(BrrrError, match=r"swap_space \(--swap-space\) must be a number of GiB >= 0, got -1"):
        EngineConfig(swap_space=-1)
    with pytest.raises(BrrrError, match="preemption_mode"):
        EngineConfig(swap_space=1, preemption_mode="offload")
    with pytest.raises(BrrrError, match="preemption_mode='swap' needs swap_space > 0"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(BrrrError, match="swap_space does not combine with speculative_config"):
        EngineConfig(swap_space=1, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(BrrrError, match="swap_space does not combine"):
        EngineConfig(swap_space=1, kv_eviction="streaming", kv_budget=64)
    # recompute forced: the host memory is unused, so nothing conflicts
    assert EngineConfig(swap_space=1, preemption_mode="recompute", kv_eviction="streaming",
                        kv_budget=64).preemption_mode == "recompute"


# ---- the engine path ---------------------------------------------------------------------------------------------
VOCAB = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("swap-model")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=512, num_key_value_heads=2), path)
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(10, 140))] for _ in range(14)]
    reqs = [(str(i), p, SamplingParams(max_tokens=rng.randint(6, 30), temperature=0)) for i, p in enumerate(prompts)]
    # two seeded samples sharing their prompt's blocks (copy-on-write when they diverge): their tokens depend only
    # on the seed and the output so far, so they too must not change
    return reqs + [("n2", prompts[0][:70], SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=7))]


def swap_gib(model, blocks, kv_cache_dtype="auto"):
    """swap_space for `blocks` host blocks of 16 tokens."""
    dtype = torch.float32 if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    return blocks * kv_bytes_per_block(model.config, 16, dtype) / 2**30


def tight(model, **kw):
    # 16 blocks of 16 tokens for 16 sequences of up to 170 tokens, 8 at a time: preemptions
    return LLMEngine(model, config=EngineConfig(num_blocks=16, block_size=16, max_num_batched_tokens=64,
                                                max_num_seqs=8, **kw))


def step_all(engine, reqs, each_step=None):
    """run_all, calling each_step(engine) after every step, and checking the host pool is whole at the end."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        sched = engine.scheduler
        if sched.swap is not None:
            sched.swap.pool.check_invariants(list(sched.waiting) + sched.running)
        if each_step is not None:
            each_step(engine)
    bm, swap = engine.block_manager, engine.scheduler.swap
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    if swap is not None:
        assert swap.pool.num_free == swap.pool.num_blocks
    return done


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_swap_gives_the_tokens_of_no_preemption_and_of_recompute(model, requests, kv_cache_dtype):
    """Greedy tokens with every preemption swapped equal those of an engine with room for everything and those of
    the recompute engine: the K/V come back as the same bytes (fp8 ones too, whose scales never move)."""
    roomy = LLMEngine(model, config=EngineConfig(num_blocks=400, max_num_batched_tokens=4096,
                                                 kv_cache_dtype=kv_cache_dtype))
    want = step_all(roomy, requests)
    assert roomy.stats()["num_preemptions"] == 0
    recompute = tight(model, kv_cache_dtype=kv_cache_dtype)
    by_recompute = step_all(recompute, requests)
    swap = tight(model, kv_cache_dtype=kv_cache_dtype, swap_space=swap_gib(model, 64, kv_cache_dtype),
                 preemption_mode="swap")
    by_swap = step_all(swap, requests)
    assert recompute.scheduler.num_preemptions > 0 and recompute.scheduler.num_swapped_out == 0
    assert swap.scheduler.num_swapped_out == swap.scheduler.num_preemptions > 0
    # a swapped sequence resumes where it was: fewer prompt tokens computed than recomputing them
    assert swap.stats()["prompt_tokens"] < recompute.stats()["prompt_tokens"]
    tokens = lambda done, rid: [o.token_ids for o in done[rid].outputs]  # noqa: E731
    for rid, _, _ in requests:
        assert tokens(by_swap, rid) == tokens(want, rid) == tokens(by_recompute, rid), f"request {rid}"


def test_each_preemption_swaps_only_above_min_tokens_and_with_pool_room(model, requests):
    engine = tight(model, swap_space=swap_gib(model, 6), preemption_mode="swap")
    engine.scheduler.swap.min_tokens = 40  # the cost rule's crossover, set where this workload crosses it

    def check(engine):
        for seq in engine.scheduler.waiting:
            assert not seq.host_table or seq.num_computed_tokens >= 40

    got = step_all(engine, requests, check)
    sched = engine.scheduler
    assert 0 < sched.num_swapped_out < sched.num_preemptions  # some swapped, some (short, or no room) recomputed
    assert set(got) == {rid for rid, _, _ in requests}


def test_abort_while_swapped_out_frees_the_host_blocks(model, requests):
    engine = tight(model, swap_space=swap_gib(model, 64), preemption_mode="swap")
    pool = engine.scheduler.swap.pool
    aborted = []

    def abort_a_swapped_one(engine):
        swapped = [seq for seq in engine.scheduler.waiting if seq.host_table]
        if swapped and not aborted:
            seq = swapped[0]
            free, held = pool.num_free, len(seq.host_table)
            assert engine.abort(seq.request.request_id)
            assert pool.num_free == free + held and not seq.host_table
            aborted.append(seq.request.request_id)

    got = step_all(engine, requests, abort_a_swapped_one)  # (checks the pool is whole at the end)
    assert aborted and set(got) == {rid for rid, _, _ in requests} - set(aborted)
    assert engine.scheduler.num_swapped_out > 1


def test_the_policy_the_config_asks_for(model):
    cpu = torch.device("cpu")
    per_block = kv_bytes_per_block(model.config, 16, torch.float32)
    ask = lambda **kw: swap_policy(EngineConfig(**kw), model.config, cpu, torch.float32, per_block, 512)  # noqa: E731
    assert ask() is None and ask(swap_space=1, preemption_mode="recompute") is None
    policy = ask(swap_space=per_block * 10 / 2**30)
    assert policy.pool.num_blocks == 10 and policy.min_tokens == 0  # CPU: no datasheet figures, every room swaps
    with pytest.raises(BrrrError, match=r"swap_space .* holds no KV block"):
        ask(swap_space=per_block / 2 / 2**30)


def test_block_runs_and_the_pool():
    assert block_runs([(3, 0), (4, 1), (5, 2), (9, 3), (10, 5)]) == [(3, 0, 3), (9, 3, 1), (10, 5, 1)]
    assert host_runs([4, 5, 6, 9, 2, 3]) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    pool = HostBlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    with pytest.raises(BrrrError, match="1 host blocks asked for, 0 free"):
        pool.allocate(1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_scattered_device_blocks_round_trip_through_the_host(model, kv_cache_dtype):
    """swap_blocks gathers device blocks from anywhere in the pool (descending, gapped) into host runs and scatters
    them back into other scattered blocks: every layer's K and V bytes come back unchanged, and the blocks no pair
    names are not touched."""
    engine = tight(model, kv_cache_dtype=kv_cache_dtype, swap_space=swap_gib(model, 8, kv_cache_dtype),
                   preemption_mode="swap")
    runner = engine.runner
    for pair in runner.kv_caches:
        for t in pair:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    before = [[t.view(torch.uint8).clone() for t in pair] for pair in runner.kv_caches]
    out = [(11, 3), (9, 4), (2, 5), (7, 0), (5, 1)]  # device -> host: host runs 3-5 and 0-1
    runner.swap_blocks(out, [])
    back = [(3, 12), (4, 1), (5, 6), (0, 14), (1, 8)]  # host -> device
    runner.swap_blocks([], back)
    moved = {dst: src for src, dst in back}
    origin = {host: dev for dev, host in out}
    for was, pair in zip(before, runner.kv_caches):
        for old, t in zip(was, pair):
            now = t.view(torch.uint8)
            for block in range(now.shape[0]):
                want = old[origin[moved[block]]] if block in moved else old[block]
                assert torch.equal(now[block], want), block
