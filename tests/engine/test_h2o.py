"""H2O eviction (heavy hitters by accumulated attention, plus the most recent tokens) through the engine, tiny llama
on CPU: after every step each KV head's kept positions equal those of a plain reference over one contiguous cache
that accumulates, picks and evicts with loops of its own (rows kept in position order, where the engine's move), and
the greedy tokens are the reference's; a sequence never holds more than the budget's blocks once its prompt is
done; chunked prefill, preemption (recompute one token a step past the prompt) and aborts leak no block and keep the
tokens; the refused combinations name the field."""
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
    path = tmp_path_factory.mktemp("h2o-model")
    hf_models.save(hf_models.build("llama3-rope", max_position_embeddings=1024), path)
    return load_model(path, dtype=torch.float32)


def h2o_engine(model, budget, num_blocks=64, **kw):
    return LLMEngine(model, config=EngineConfig(num_blocks=num_blocks, block_size=BS, kv_eviction="h2o",
                                                kv_budget=budget, enable_prefix_caching=False, **kw))


def add_mass(acc, kept, q, keys, scale, q_pos):
    """acc[h][position] += the attention q (at q_pos) gives each row of keys (rows hold kept[h], in order)."""
    n_kv = keys.shape[1]
    group = q.shape[0] // n_kv
    for h in range(n_kv):
        visible = [r for r, t in enumerate(kept[h]) if t <= q_pos]
        for g in range(group):
            probs = ((keys[visible, h] @ q[h * group + g]) * scale).softmax(0)
            for r, prob in zip(visible, probs.tolist()):
                acc[h][kept[h][r]] += prob


@torch.no_grad()
def h2o_reference(model, prompt, new_tokens, budget, kv_dtype=None):
    """Greedy tokens and, after the prompt's step and each decode step, each layer's kept positions per head: the
    model over one contiguous cache per layer whose rows hold each head's kept positions in order; queries caught
    through AttnMeta.observe. kv_dtype: an fp8 cache (scales 1.0), scored on its values, moved as bytes."""
    cfg, n = model.config, len(prompt)
    capacity, recent = budget - 1, budget // 2
    shape = (1, max(n, budget) + 1, cfg.num_kv_heads, cfg.head_dim)
    pair = (lambda k, v: (k, v)) if kv_dtype is None else QuantKV
    caches = [pair(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
              for _ in range(cfg.num_layers)]
    heads = range(cfg.num_kv_heads)
    kept = [[list(range(n)) for _ in heads] for _ in caches]
    acc = [[dict.fromkeys(range(n), 0.0) for _ in heads] for _ in caches]
    queries = {}
    meta = AttnMeta(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seqlens_q=[n], context_lens=[n],
                    slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32), kv_caches=caches,
                    observe=lambda layer, q, scale: queries.update({layer: (q.clone(), scale)}))
    logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta)[-1:])
    for layer, (k, v) in enumerate(caches):
        q, scale = queries[layer]
        for i in range(n):
            add_mass(acc[layer], kept[layer], q[i], k[0, :n].float(), scale, i)
        if n > capacity:
            for h in heads:
                a = acc[layer][h]
                top = sorted(range(n - recent), key=lambda t: (-a[t], t))[: capacity - recent]
                keep = sorted(top) + list(range(n - recent, n))
                for c in (as_bytes(k), as_bytes(v)):
                    c[0, :capacity, h] = c[0, keep, h].clone()
                kept[layer][h], acc[layer][h] = keep, {t: a[t] for t in keep}
    length = min(n, capacity)
    history = [[[list(rows) for rows in layer] for layer in kept]]
    tokens = []
    for i in range(new_tokens):
        token = int(logits[0].argmax())
        tokens.append(token)
        p = n + i
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seqlens_q=[1],
                        context_lens=[length + 1], slot_mapping=torch.tensor([length]),
                        block_tables=torch.zeros(1, 1, dtype=torch.int32), kv_caches=caches,
                        observe=lambda layer, q, scale: queries.update({layer: (q.clone(), scale)}))
        logits = model.compute_logits(model(torch.tensor([token]), torch.tensor([p]), meta))
        for layer, (k, v) in enumerate(caches):
            q, scale = queries[layer]
            for h in heads:
                kept[layer][h].append(p)
                acc[layer][h][p] = 0.0
            add_mass(acc[layer], kept[layer], q[0], k[0, :length + 1].float(), scale, p)
            if length + 1 > capacity:
                for h in heads:
                    a = acc[layer][h]
                    victim = min((t for t in kept[layer][h] if t <= p - recent), key=lambda t: (a[t], t))
                    r = kept[layer][h].index(victim)
                    for c in (as_bytes(k), as_bytes(v)):  # the rows after it move down one: position order kept
                        c[0, r:length, h] = c[0, r + 1:length + 1, h].clone()
                    kept[layer][h].remove(victim)
                    del a[victim]
        length = min(length + 1, capacity)
        history.append([[list(rows) for rows in layer] for layer in kept])
    return tokens, history


def engine_kept(engine, seq):
    """Each layer's kept positions per head, ascending, from the engine's per-sequence state."""
    _, pos = engine.scheduler.eviction.state.sequences[seq.seq_id]
    rows = seq.num_computed_tokens - seq.num_dropped_tokens
    return [[sorted(pos[layer, h, :rows].tolist()) for h in range(pos.shape[1])] for layer in range(pos.shape[0])]


@pytest.mark.parametrize("prompt_len, new, kv_cache_dtype", [
    (100, 60, "auto"), (20, 90, "auto"), (100, 60, "fp8")])  # compacted at the prompt's end / not; an fp8 cache
def test_kept_positions_and_greedy_tokens_equal_the_reference_and_stay_in_budget(model, prompt_len, new,
                                                                                  kv_cache_dtype):
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    budget = 64
    want, history = h2o_reference(model, prompt, new, budget,
                                  None if kv_cache_dtype == "auto" else torch.float8_e4m3fn)
    engine = h2o_engine(model, budget, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("a", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    out, step = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            assert engine_kept(engine, seq) == history[step], f"step {step}"
            assert len(seq.block_table) <= budget // BS
            assert seq.num_computed_tokens - seq.num_dropped_tokens <= budget - 1
        step += 1
    assert step == new and out.outputs[0].token_ids == want
    assert history[-1][0][0] != list(range(prompt_len + new - budget + 1, prompt_len + new))  # not just recency
    assert engine.scheduler.eviction.state.sequences == {}


def test_chunked_prefill_preemption_and_aborts_leak_nothing_and_keep_the_tokens(model):
    """Five sequences (prompts of 10-100 tokens, 80 new tokens) on a 64-token budget, 40 tokens a step, in a pool
    of 10 blocks: the short ones grow while the long one, compacted and evicting, is preempted and recomputes its
    prompt (compacting it again), then its tokens one a step; each gives the tokens it gives alone; an abort frees
    every block and state (check_invariants after every step)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (10, 12, 100, 30, 14)]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    alone = {str(i): run_all(h2o_engine(model, 64, max_num_batched_tokens=40), [(str(i), p, params)])[str(i)]
             for i, p in enumerate(prompts) if i != 3}
    engine = h2o_engine(model, 64, num_blocks=10, max_num_batched_tokens=40)
    sched, evicted_then_preempted = engine.scheduler, []
    preempt = sched.preempt
    sched.preempt = lambda seq, *rest: (evicted_then_preempted.append(seq.num_dropped_tokens > 0), preempt(seq, *rest))

    def check(engine):
        engine.block_manager.check_invariants(sched.running + list(sched.waiting))
        for s in sched.running:
            if s.num_computed_tokens > s.num_prompt_tokens:
                assert len(s.block_table) <= 64 // BS

    done = run_all(engine, [(str(i), p, params) for i, p in enumerate(prompts)], abort_at={"3": 30},
                   each_step=check)  # run_all checks every block came back
    assert any(evicted_then_preempted)  # a recompute past the prompt, evicting one token a step
    assert engine.scheduler.eviction.state.sequences == {}
    for rid, want in alone.items():
        assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids, f"request {rid}"


def test_n_above_one_is_refused_naming_the_field(model):
    with pytest.raises(BrrrError, match="SamplingParams.n must be 1 with kv_eviction='h2o'"):
        h2o_engine(model, 64).add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, n=2))


@pytest.mark.parametrize("bad, message", [
    (dict(kv_eviction="h2o", kv_budget=64), "enable_prefix_caching must be False with kv_eviction='h2o'"),
    (dict(kv_eviction="h2o", kv_budget=16, enable_prefix_caching=False), "kv_budget must be an integer >= 32"),
])
def test_bad_h2o_settings_name_the_field(bad, message):
    with pytest.raises(BrrrError, match=message):
        EngineConfig(block_size=BS, **bad)
