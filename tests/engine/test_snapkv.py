"""SnapKV eviction (one compaction per prompt at the end of its prefill) through the engine, tiny llama on CPU: the
kept K/V rows and the greedy tokens equal a plain reference over one contiguous cache that scores, pools, picks and
compacts with loops of its own; after the compaction a sequence holds the budget's blocks plus its generated tokens';
chunked prefill, preemption and aborts leak no block and keep the tokens; the refused combinations name the field."""
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

VOCAB, BS, WINDOW, KERNEL = 256, 16, 32, 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("snapkv-model")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=1024), path)
    return load_model(path, dtype=torch.float32)


def snapkv_engine(model, budget, num_blocks=64, **kw):
    return LLMEngine(model, config=EngineConfig(num_blocks=num_blocks, block_size=BS, kv_eviction="snapkv",
                                                kv_budget=budget, enable_prefix_caching=False, **kw))


def keep_ref(q, keys, scale, window, budget):
    """The positions each KV head keeps, by loops: q [W, H, D] the window's queries, keys [P, KVH, D]."""
    p, n_kv = keys.shape[0], keys.shape[1]
    group = q.shape[1] // n_kv
    kept = []
    for h in range(n_kv):
        score = torch.zeros(p - window, dtype=torch.float64)
        for g in range(group):
            for i in range(window):
                pos = p - window + i  # the query's position: it sees keys 0..pos
                attn = ((keys[: pos + 1, h].double() @ q[i, h * group + g].double()) * scale).softmax(0)
                score += attn[: p - window]
        pooled = [max(score[max(0, t - KERNEL // 2): t + KERNEL // 2 + 1]).item() for t in range(p - window)]
        top = sorted(range(p - window), key=lambda t: (-pooled[t], t))[: budget - window]
        kept.append(sorted(top) + list(range(p - window, p)))
    return kept


@torch.no_grad()
def snapkv_reference(model, prompt, new_tokens, budget, kv_dtype=None):
    """Greedy tokens from the model over one contiguous cache per layer: the prompt prefilled at once, its window's
    queries caught through AttnMeta.observe; then, if the prompt is longer than the budget, each head's kept rows
    (`keep_ref`) moved to the cache's first `budget` rows, and decode goes on from position len(prompt). kv_dtype:
    an fp8 cache (scales 1.0, as the engine's): scored on its values, moved as bytes.
    Returns (tokens, each layer's compacted (k, v) rows, each layer's kept positions per head)."""
    cfg, n = model.config, len(prompt)
    window = min(WINDOW, n, budget)
    shape = (1, n + new_tokens, cfg.num_kv_heads, cfg.head_dim)
    pair = (lambda k, v: (k, v)) if kv_dtype is None else QuantKV
    caches = [pair(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
              for _ in range(cfg.num_layers)]
    queries = {}
    meta = AttnMeta(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seqlens_q=[n], context_lens=[n],
                    slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                    kv_caches=caches, observe=lambda layer, q, scale: queries.update({layer: (q[-window:], scale)}))
    logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta)[-1:])
    length, kept = n, []
    if n > budget:
        for layer, (k, v) in enumerate(caches):
            q, scale = queries[layer]
            keep = keep_ref(q, k[0, :n].float(), scale, window, budget)
            for h, rows in enumerate(keep):
                for c in (as_bytes(k), as_bytes(v)):
                    c[0, :budget, h] = c[0, rows, h].clone()
            kept.append(keep)
        length = budget
    compacted = [(as_bytes(k)[0, :length].clone(), as_bytes(v)[0, :length].clone()) for k, v in caches]
    tokens = []
    for i in range(new_tokens):
        token = int(logits[0].argmax())
        tokens.append(token)
        slot = length + i
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seqlens_q=[1], context_lens=[slot + 1],
                        slot_mapping=torch.tensor([slot]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        kv_caches=caches)
        logits = model.compute_logits(model(torch.tensor([token]), torch.tensor([n + i]), meta))
    return tokens, compacted, kept


def cache_rows(engine, seq, n):
    """The engine's first n cache rows of seq, per layer: (k, v) [n, KVH, D] (an fp8 cache's bytes)."""
    rows = [b * BS + o for b in seq.block_table for o in range(BS)][:n]
    return [(as_bytes(k).flatten(0, 1)[rows], as_bytes(v).flatten(0, 1)[rows]) for k, v in engine.runner.kv_caches]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kept_rows_and_greedy_tokens_equal_the_reference_and_blocks_stay_in_budget(model, kv_cache_dtype):
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(150)]
    budget, new = 64, 80
    want, compacted, kept = snapkv_reference(model, prompt, new, budget,
                                             None if kv_cache_dtype == "auto" else torch.float8_e4m3fn)
    assert all(len(rows) == budget and rows[-WINDOW:] == list(range(150 - WINDOW, 150)) and rows != list(range(
        150 - budget, 150)) for keep in kept for rows in keep)  # the window, and not merely the last tokens
    engine = snapkv_engine(model, budget, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("a", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    engine.step()  # the whole prompt in one step: scored, compacted, its first token sampled
    (seq,) = engine.scheduler.running
    assert seq.num_dropped_tokens == 150 - budget and len(seq.block_table) == budget // BS
    for (k, v), (want_k, want_v) in zip(cache_rows(engine, seq, budget), compacted):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)  # the same positions kept, per head, in order
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for s in engine.scheduler.running:
            assert len(s.block_table) <= -(-(budget + s.num_output_tokens) // BS)
    assert out.outputs[0].token_ids == want
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_within_the_budget_is_not_compacted(model):
    prompt = list(range(40))
    want, _, kept = snapkv_reference(model, prompt, 30, 64)
    assert kept == []
    got = run_all(snapkv_engine(model, 64), [("a", prompt, SamplingParams(max_tokens=30, temperature=0,
                                                                         ignore_eos=True))])["a"]
    assert got.outputs[0].token_ids == want


def test_chunked_prefill_preemption_and_aborts_leak_nothing_and_keep_the_tokens(model):
    """Five sequences (prompts of 20-150 tokens, 120 new tokens) on a 64-token budget, 40 tokens a step (the window
    is never split: a chunk stops before it or takes it whole) in a pool of 24 blocks: preempted ones recompute the
    prompt, compact it again and recompute their tokens over it; they give the tokens they give alone, and the
    reference's; an abort frees every block (check_invariants after every step)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 150))] for _ in range(5)]
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    alone = {str(i): run_all(snapkv_engine(model, 64, max_num_batched_tokens=40), [(str(i), p, params)])[str(i)]
             for i, p in enumerate(prompts) if i != 3}
    engine = snapkv_engine(model, 64, num_blocks=24, max_num_batched_tokens=40)

    def check(engine):
        sched = engine.scheduler
        engine.block_manager.check_invariants(sched.running + list(sched.waiting))
        for s in sched.running:
            if s.num_computed_tokens > s.num_prompt_tokens:  # compacted (or short): the budget plus its tokens
                assert len(s.block_table) <= -(-(min(64, s.num_prompt_tokens) + s.num_output_tokens) // BS)

    done = run_all(engine, [(str(i), p, params) for i, p in enumerate(prompts)], abort_at={"3": 30},
                   each_step=check)  # run_all checks every block came back
    assert engine.scheduler.num_preemptions > 0
    for rid, want in alone.items():
        assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids, f"request {rid}"
    longest = max((i for i in range(5) if i != 3), key=lambda i: len(prompts[i]))
    assert alone[str(longest)].outputs[0].token_ids == snapkv_reference(model, prompts[longest], 120, 64)[0]


def test_n_above_one_is_refused_naming_the_field(model):
    engine = snapkv_engine(model, 64)
    with pytest.raises(BrrrError, match="SamplingParams.n must be 1 with kv_eviction='snapkv'"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, n=2))


@pytest.mark.parametrize("bad, message", [
    (dict(kv_eviction="snapkv", kv_budget=64), "enable_prefix_caching must be False with kv_eviction='snapkv'"),
    (dict(kv_eviction="snapkv", kv_budget=16, enable_prefix_caching=False), "kv_budget must be an integer >= 32"),
    (dict(kv_eviction="snapkv", kv_budget=64, enable_prefix_caching=False, max_num_batched_tokens=16),
     "max_num_batched_tokens \\(16\\) must be >= 32"),
])
def test_bad_snapkv_settings_name_the_field(bad, message):
    with pytest.raises(BrrrError, match=message):
        EngineConfig(block_size=BS, **bad)


def test_decode_steps_after_the_compaction_are_planned_ahead(model):
    """SnapKV evicts once, at the prompt's end; its decode steps then run as any decode (step t+1 planned before
    step t's tokens reach the host, through graphs: eager stand-ins on CPU), the compaction step itself never: the
    tokens stay the reference's."""
    from tests.engine.test_graph_inputs import EagerReplay

    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(150)]
    want, _, _ = snapkv_reference(model, prompt, 40, 64)
    engine = snapkv_engine(model, 64)
    engine.runner.capture_cuda_graphs(2, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
    planned, plan_ahead = [], engine.scheduler.schedule_next_decode

    def counting(batch):
        nxt = plan_ahead(batch)
        planned.append((bool(batch.eviction), nxt is not None))
        return nxt

    engine.scheduler.schedule_next_decode = counting
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    out = [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step()][-1]
    assert out.outputs[0].token_ids == want
    assert any(ahead for _, ahead in planned) and not any(compacting and ahead for compacting, ahead in planned)
    engine.block_manager.check_invariants([])
