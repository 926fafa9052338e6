"""The engine against transformers: exact greedy tokens under preemption, chunking, prefix hits, n > 1, aborts."""
import random

import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.sampling_params import SamplingParams
from tests import hf_models

VOCAB = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-model")
    hf = hf_models.build("llama3-rope", max_position_embeddings=512, num_key_value_heads=2)
    hf_models.save(hf, path)
    return hf, load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(120)]
    prompts = []
    for i in range(64):
        length = rng.randint(1, 300)
        head = shared[: rng.randint(16, 120)] if i % 3 == 0 else []  # a third share a prefix: cache hits
        prompts.append((head + [rng.randrange(VOCAB) for _ in range(length)])[: max(length, 1)])
    return prompts, [rng.randint(1, 24) for _ in prompts]


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: else generate() masks every token equal to pad_token_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(models, workload):
    hf, _ = models
    return [hf_greedy(hf, p, n) for p, n in zip(*workload)]


def run_all(engine, requests, abort_at=None, each_step=None):
    """Add every request, step until done; abort_at: {request_id: step} aborts mid-flight; each_step(engine) runs
    after every step (its checks). Returns finished outputs, after checking that every block came back."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        for rid, at in (abort_at or {}).items():
            if at == step:
                engine.abort(rid)
        if each_step is not None:
            each_step(engine)
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return done


def small_engine(model, **kw):
    # 40 blocks of 16 tokens: far fewer than 64 requests need -> preemption; 64-token budget -> chunked prefill
    return LLMEngine(model, config=EngineConfig(num_blocks=40, block_size=16, max_num_batched_tokens=64,
                                                max_num_seqs=16, **kw))


def test_greedy_tokens_equal_transformers_under_preemption_chunking_and_prefix_hits(models, workload, expected):
    _, model = models
    engine = small_engine(model)
    prompts, lengths = workload
    reqs = [(str(i), p, SamplingParams(max_tokens=n, temperature=0)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    done = run_all(engine, reqs)
    for i, want in enumerate(expected):
        assert done[str(i)].outputs[0].token_ids == want, f"request {i}"
        assert done[str(i)].outputs[0].finish_reason == "length"
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert engine.num_steps > max(lengths)  # many steps mixed decodes with prefill chunks


def test_n3_and_aborts_stay_exact_and_free_everything(models, workload, expected):
    _, model = models
    engine = small_engine(model)
    prompts, lengths = workload
    reqs = [(str(i), p, SamplingParams(max_tokens=n, temperature=0, n=3 if i % 4 == 0 else 1))
            for i, (p, n) in enumerate(zip(prompts[:32], lengths[:32]))]
    aborted = {str(i): 3 + i for i in range(1, 32, 5)}
    done = run_all(engine, reqs, abort_at=aborted)
    for i in range(32):
        rid = str(i)
        if rid in aborted and rid not in done:
            continue  # aborted before it finished
        outs = done[rid].outputs
        assert len(outs) == (3 if i % 4 == 0 else 1)
        for out in outs:
            assert out.token_ids == expected[i], f"request {i} sample {out.index}"


def test_seeded_sampling_is_independent_of_the_batch(models):
    _, model = models
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = run_all(LLMEngine(model, config=EngineConfig(num_blocks=64)), [("x", [5, 6, 7, 8], params)])["x"]
    rng = random.Random(1)
    crowd = [(f"o{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))],
              SamplingParams(max_tokens=10, temperature=0.7)) for i in range(10)]
    batched = run_all(small_engine(model), crowd[:5] + [("x", [5, 6, 7, 8], params)] + crowd[5:])["x"]
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_and_prompt_logprobs(models):
    hf, model = models
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = run_all(LLMEngine(model, config=EngineConfig(num_blocks=64)),
                  [("a", prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2))])["a"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]] - ref[pos - 1, prompt[pos]].item()) < 1e-4 and len(entry) <= 3
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token] - row[token].item()) < 1e-4
        assert token == int(row.argmax()) and set(row.topk(3).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(max_tokens=600), "exceeds the model's context of 512"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(n=0), "n must be in \\[1, 128\\]"),
])
def test_bad_requests_raise_value_error_and_engine_keeps_serving(models, bad, message):
    _, model = models
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64))
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    prompt = bad.pop("prompt", [1, 2, 3])
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(**bad))
    done = run_all(engine, [])
    assert done["ok"].outputs[0].finish_reason == "length" and len(done["ok"].outputs[0].token_ids) == 3


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(models, monkeypatch):
    _, model = models
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64))
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device error")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    engine.step()
    failed = engine.step()
    assert failed[0].finished and "simulated device error" in failed[0].error
    assert failed[0].outputs[0].finish_reason == "abort"
    done = run_all(engine, [("b", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0))])
    assert len(done["b"].outputs[0].token_ids) == 4


def test_forks_never_exceed_max_num_seqs(models, workload, expected):
    """Two n=4 requests on max_num_seqs=2: forks beyond the free places wait their turn (like preempted sequences)
    instead of joining the batch, and every sample still gets transformers' tokens."""
    _, model = models
    prompts, lengths = workload
    picked = [i for i in range(len(prompts)) if lengths[i] >= 4][:2]
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, block_size=16, max_num_seqs=2))
    for i in picked:
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0, n=4))
    done, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    assert most == 2
    for i in picked:
        assert [c.token_ids for c in done[str(i)].outputs] == [expected[i]] * 4, f"request {i}"
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_kv_cache_sizing_counts_what_the_device_has_in_use(models, monkeypatch):
    """The KV cache gets this process's share (total * utilization) less what it holds and the profiled step's
    activations, and never more than the driver reports free (the CUDA context, other processes) less those."""
    from types import SimpleNamespace

    from brrr.engine.model_runner import ModelRunner, kv_bytes_per_block

    _, model = models
    gib = 1 << 30
    per_block = kv_bytes_per_block(model.config, 16, torch.float32)
    for free, want in ((76 * gib, 80 * gib * 0.9 - 2 * gib - 1 * gib),  # alone: the share binds
                       (20 * gib, 20 * gib - 1 * gib)):  # another process holds 56 GiB: what is free binds
        fakes = {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda device=None: None,
                 "synchronize": lambda device=None: None, "memory_allocated": lambda device=None: 2 * gib,
                 "max_memory_allocated": lambda device=None: 3 * gib,  # the profiled step: 1 GiB of activations
                 "memory_reserved": lambda device=None: 2 * gib,
                 "mem_get_info": lambda device=None, free=free: (free, 80 * gib),
                 "get_device_properties": lambda device=None: SimpleNamespace(total_memory=80 * gib)}
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)
        assert ModelRunner.profile_num_blocks(model, 16, 64, 0.9) == int(want) // per_block


def count_reads(monkeypatch) -> dict:
    """Counts reads of device values to the host (each one a wait for the device on a GPU)."""
    reads = {"n": 0}
    for name in ("tolist", "item", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, real=real, **kwargs):
            reads["n"] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return reads


def test_prompt_logprobs_read_back_once_per_step(models, monkeypatch):
    """Prompt logprobs for a 40-token prompt in one step: one read-back for all of them (and one for the sampled
    token), not a few per prompt token."""
    _, model = models
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64, max_num_batched_tokens=64))
    engine.add_request("a", list(range(7, 47)), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    reads = count_reads(monkeypatch)
    (out,) = engine.step()
    monkeypatch.undo()
    assert out.finished and len(out.prompt_logprobs) == 40 and all(len(e) <= 3 for e in out.prompt_logprobs[1:])
    assert reads["n"] <= 2, f"{reads['n']} host reads of device values in one step"


def test_sampled_logprobs_read_back_once_per_step(models, monkeypatch):
    _, model = models
    engine = LLMEngine(model, config=EngineConfig(num_blocks=64))
    for i in range(6):
        engine.add_request(str(i), [3 + i, 4, 5], SamplingParams(max_tokens=2, temperature=0, logprobs=2))
    engine.step()  # the prompts
    reads = count_reads(monkeypatch)
    outs = engine.step()
    monkeypatch.undo()
    assert len(outs) == 6 and all(len(o.outputs[0].logprobs) == 2 for o in outs)
    assert reads["n"] <= 2, f"{reads['n']} host reads of device values in one step"
