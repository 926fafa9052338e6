"""Tensor-parallel serving on CPU (gloo, fp32): TP = 2 and 4 give TP = 1's greedy tokens under engine stress, with
log-probs within 1e-4, eagerly and through (stand-in) decode graphs; each rank holds only its slices; bad N fails
before any weight loads; a killed worker fails the engine's requests with a clear error instead of hanging, and
takes a served engine down (health 503)."""
import asyncio
import json
import os
import signal
import time

import pytest
import torch
from safetensors import safe_open

from brrr import LLM, BrrrError, SamplingParams
from brrr.config import ModelConfig
from brrr.distributed.sharding import check_tensor_parallel
from tests import hf_models
from tests.engine.test_graph_inputs import EagerReplay

VOCAB = 321  # not a multiple of 2 or 4: the vocabulary-parallel shards are padded
# fp32 sums in another order (the all-reduce adds the ranks' partial products): a few ulps of the logits
LOGPROB_TOLERANCE = 1e-4
# a pool of 16 blocks of 4 tokens for 20 requests that each need up to 5: preemptions; a 24-token budget: prompts
# prefill in chunks; prompts that share a 12-token start: prefix-cache hits
STRESS = dict(dtype="float32", device="cpu", block_size=4, num_blocks=16, max_num_batched_tokens=24, max_num_seqs=8)


def _model_dir(tmp_path_factory, family: str, **overrides):
    path = tmp_path_factory.mktemp(f"tp-{family}")
    hf_models.save_tokenizer(path)
    model = hf_models.build(family, vocab_size=VOCAB, **overrides)
    return hf_models.save(model, path, sharded=True)  # several files


def _prompts():
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    return [shared + [20 + i, 30 + i] if i % 2 else [1 + i, 5, 40 + i] * (1 + i % 3) for i in range(20)]


def _run(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _compare_with_one_rank(path, n):
    """Run the stress workload at TP 1 and TP n; assert equal greedy tokens and close log-probs. Returns the TP n
    engine's rank-0 model and every rank's parameter shapes."""
    want = _run(LLM(str(path), **STRESS))
    llm = LLM(str(path), tensor_parallel_size=n, **STRESS)
    try:
        tokens, logprobs = _run(llm)
        shards = llm.engine.runner.shard_shapes()
    finally:
        llm.engine.runner.shutdown()
    assert tokens == want[0] and _close(logprobs, want[1])
    return llm.engine.model, shards


def _close(a, b):
    return all(x.keys() == y.keys() and all(abs(x[t] - y[t]) <= LOGPROB_TOLERANCE for t in x)
               for seq_a, seq_b in zip(a, b) for x, y in zip(seq_a, seq_b))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _model_dir(tmp_path_factory, "llama3-rope")  # 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def reference(llama):
    return _run(LLM(str(llama), **STRESS))


@pytest.fixture(scope="module")
def tp2(llama):
    llm = LLM(str(llama), tensor_parallel_size=2, **STRESS)
    yield llm
    llm.engine.runner.shutdown()


def test_tp2_gives_the_greedy_tokens_of_one_rank_under_stress(tp2, reference):
    tokens, logprobs = _run(tp2)
    assert tokens == reference[0]
    assert _close(logprobs, reference[1])
    stats = tp2.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_steps"] > 20


def eager_capture(step, pool):  # module level: the workers unpickle it (EagerReplay: a CPU stand-in for a graph)
    graph = EagerReplay(step)
    return graph, graph.logits


def test_decode_graphs_replay_on_every_rank(tp2, reference):
    runner = tp2.engine.runner
    runner.capture_cuda_graphs(8, 64, capture=eager_capture)
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    replays, real = [], runner._replay
    runner._replay = lambda batch, ids_from=None: replays.append((len(batch.items), ids_from is not None)) or real(
        batch, ids_from)
    try:
        tokens, logprobs = _run(tp2)
        # without logprobs (read on the host) steady decoding launches ahead: ids broadcast from rank 0's tokens
        plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        ahead_tokens = [o.outputs[0].token_ids for o in tp2.generate(_prompts(), plain, use_tqdm=False)]
    finally:
        del runner._replay
    assert ahead_tokens == reference[0]
    assert len(replays) > 10 and max(rows for rows, _ in replays) > 1  # decode steps of several rows: graphs
    # steps launched ahead (their ids broadcast from rank 0's sampled tokens) and steps staged from the host
    assert {ahead for _, ahead in replays} == {True, False}
    assert tokens == reference[0] and _close(logprobs, reference[1])


def test_all_reduce_choice_falls_back_to_the_group_on_every_rank(tp2, reference, caplog):
    """The start-up choice (run on CUDA engines) as a gloo group meets it: the one-shot setup fails on every rank
    (no CUDA symmetric memory), rank 0 logs why once, every rank keeps the group's all-reduce, and the ranks stay
    in step."""
    with caplog.at_level("INFO", logger="brrr.engine"):
        assert tp2.engine.runner.choose_all_reduce(8) == 0
    lines = [r.getMessage() for r in caplog.records if "tensor-parallel all-reduce" in r.getMessage()]
    assert len(lines) == 1 and "NCCL for every message" in lines[0] and "CUDA" in lines[0]
    assert tp2.engine.model.tp_comm.oneshot is None
    assert _run(tp2)[0] == reference[0]


def test_a_second_engine_in_a_process_keeps_nccl(tp2, reference, caplog, monkeypatch):
    """After a symmetric-memory rendezvous in this process (an earlier engine's), the choice does not try another:
    the new engine's workers would count their rendezvous from 0 and rank 0 from 1 (a hang on GPUs, seen once).
    Every rank keeps the group's all-reduce and the reason is logged."""
    import brrr.distributed.oneshot as oneshot

    monkeypatch.setattr(oneshot, "_rendezvous_begun", 1)
    with caplog.at_level("INFO", logger="brrr.engine"):
        assert tp2.engine.runner.choose_all_reduce(8) == 0
    lines = [r.getMessage() for r in caplog.records if "tensor-parallel all-reduce" in r.getMessage()]
    assert len(lines) == 1 and "one engine per process" in lines[0] and "CUDA" not in lines[0]
    assert tp2.engine.model.tp_comm.oneshot is None
    assert _run(tp2)[0] == reference[0]


def test_tp4_with_one_replicated_kv_head_per_rank(tmp_path_factory):
    path = _model_dir(tmp_path_factory, "mqa")  # 1 KV head for 4 ranks: each rank holds a copy
    _, shards = _compare_with_one_rank(path, 4)
    assert [s["model.layers.0.self_attn.k_proj.weight"][0] for s in shards] == [(16, 64)] * 4


def test_tp2_with_biases_and_tied_embeddings(tmp_path_factory):
    # q/k/v and gate/up biases sliced with their rows, o_proj/down_proj biases added once after the all-reduce;
    # lm_head is the embedding's own vocabulary shard
    path = _model_dir(tmp_path_factory, "llama-attn-bias", tie_word_embeddings=True)
    model, _ = _compare_with_one_rank(path, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_each_rank_holds_only_its_slices(tp2, llama):
    cfg = ModelConfig.from_dir(llama)
    shards = tp2.engine.runner.shard_shapes()
    d, hidden, vocab_rows = cfg.head_dim, cfg.hidden_size, -(-VOCAB // 2)
    want = {"model.embed_tokens.weight": (vocab_rows, hidden), "lm_head.weight": (vocab_rows, hidden),
            "model.layers.1.self_attn.q_proj.weight": (cfg.num_heads // 2 * d, hidden),
            "model.layers.1.self_attn.k_proj.weight": (cfg.num_kv_heads // 2 * d, hidden),
            "model.layers.1.self_attn.o_proj.weight": (hidden, cfg.num_heads // 2 * d),
            "model.layers.1.mlp.gate_proj.weight": (cfg.intermediate_size // 2, hidden),
            "model.layers.1.mlp.down_proj.weight": (hidden, cfg.intermediate_size // 2),
            "model.norm.weight": (hidden,)}
    full = 0
    for f in sorted(llama.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            full += sum(h.get_tensor(n).nbytes for n in h.keys())
    norms = sum(b for n, (_, b) in shards[0].items() if "norm" in n)
    for shard in shards:
        assert {n: shard[n][0] for n in want} == want
        # half of every sharded tensor (plus the vocabulary's padding row), all of the norms
        assert sum(b for _, b in shard.values()) == (full - norms) // 2 + 2 * hidden * 4 // 2 + norms
    # rank 0 holds the first half of q_proj's rows, exactly the checkpoint's values
    index = json.loads((llama / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    with safe_open(str(llama / index[name]), "pt") as h:
        first = h.get_tensor(name)[: cfg.num_heads // 2 * d]
    assert torch.equal(tp2.engine.model.get_parameter(name), first)


@pytest.mark.parametrize("overrides, n, message", [
    (dict(num_attention_heads=4, num_key_value_heads=4), 3, r"tensor-parallel-size.* = 3 must divide the model's 4 "
                                                            "attention heads"),
    (dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=132), 8,
     r"= 8 must divide the model's intermediate size 132"),
    (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), 2,
     r"= 2 must divide the model's 3 KV heads, or be a multiple of them"),
])
def test_bad_tensor_parallel_size_fails_before_any_weight_loads(tmp_path, overrides, n, message):
    # a config and a tokenizer, no weights at all: the error must come from the check, not from loading
    config = hf_models.build("llama3-rope", **overrides).config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    hf_models.save_tokenizer(tmp_path)
    start = time.monotonic()
    with pytest.raises(BrrrError, match=message):
        LLM(str(tmp_path), dtype="float32", device="cpu", tensor_parallel_size=n)
    assert time.monotonic() - start < 10  # no worker was started


def test_more_ranks_than_gpus_is_refused(monkeypatch, llama):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(BrrrError, match=r"--tensor-parallel-size .* = 4 exceeds the 2 CUDA GPU\(s\) from cuda:0"):
        check_tensor_parallel(ModelConfig.from_dir(llama), 4, torch.device("cuda"))


def test_a_killed_worker_fails_the_engine_cleanly(llama):
    llm = LLM(str(llama), tensor_parallel_size=2, **STRESS)
    runner = llm.engine.runner
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    worker = runner.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    assert time.monotonic() - start < 30
    for out in outs:
        assert out.outputs[0].finish_reason == "abort"
        assert "tensor-parallel worker rank 1" in out.error and "the engine is down" in out.error
    assert not llm.engine.has_unfinished_requests()
    runner.shutdown()
    assert all(not p.is_alive() for p in runner.workers.procs)


def test_a_killed_worker_makes_the_server_engine_unhealthy(llama):
    from brrr.config import EngineConfig
    from brrr.distributed.tp_loader import load_pretrained
    from brrr.engine.async_llm import AsyncLLM
    from brrr.engine.core import EngineCore

    config = {k: v for k, v in STRESS.items() if k not in ("dtype", "device")}
    pretrained, config = load_pretrained(str(llama), "float32", "cpu", EngineConfig(tensor_parallel_size=2, **config))
    engine = EngineCore(pretrained.model, pretrained.tokenizer, config, pretrained.eos_token_ids)
    llm = AsyncLLM(engine)
    try:
        os.kill(engine.runner.workers.procs[0].pid, signal.SIGKILL)
        engine.runner.workers.procs[0].join(10)

        async def one():
            return [out async for out in llm.generate([1, 2, 3], SamplingParams(max_tokens=4))][-1]

        out = asyncio.run(asyncio.wait_for(one(), 30))
        assert "tensor-parallel worker rank 1" in out.error
        deadline = time.monotonic() + 10
        while llm.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.healthy and "tensor-parallel worker rank 1" in llm.failure
    finally:
        llm.shutdown()
        engine.runner.shutdown()


@pytest.mark.parametrize("method", ["rtn-int8", "rtn-int4", "fp8"])
def test_tp2_shards_quantized_checkpoints(tmp_path, llama, method):
    from brrr.loader import load_model
    from brrr.quant.checkpoint import save_quantized
    from brrr.quant.methods import quantize_model

    model = load_model(llama, dtype=torch.float32)
    # group 32: each rank's 32 o_proj and 64 down_proj input columns hold whole groups
    save_quantized(model, quantize_model(model, method, group_size=32), tmp_path, source_dir=llama)
    _, shards = _compare_with_one_rank(tmp_path, 2)
    assert not any(name.endswith("proj.weight") for shard in shards for name in shard)  # no float projections
    if method == "rtn-int4":  # at TP 4 a rank's o_proj input (one head, 16 columns) splits an int4 group
        with pytest.raises(BrrrError, match=r"attention output width \(16\) must be a multiple of the int4 group"):
            LLM(str(tmp_path), tensor_parallel_size=4, **STRESS)


def test_brrr_serve_tensor_parallel_size_answers_like_one_rank(llama, reference):
    import httpx

    from tests.server.test_cli import start_server, stop_server

    # on a loaded machine two ranks load slowly; a start that fails stops the server and its workers itself
    proc, url = start_server(llama, "--tensor-parallel-size", "2", start_timeout=240)
    try:
        prompt = _prompts()[0]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert len(got["logprobs"]["token_logprobs"]) == 6
        want = [max(step.values()) for step in reference[1][0]]  # greedy: the chosen token's log-prob is the top one
        assert all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(got["logprobs"]["token_logprobs"], want))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # the engine process and its worker stopped with it
    finally:
        stop_server(proc)  # a failed check too: the server, its engine process and its worker


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group pgid (Linux: /proc/PID/stat's fifth field)."""
    members = []
    for stat in os.listdir("/proc"):
        try:
            with open(f"/proc/{stat}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat))
    return members


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process groups from /proc")
def test_a_server_start_that_times_out_stops_the_server_and_its_workers(llama, monkeypatch):
    from tests.server import test_cli

    seen, stop = [], test_cli.stop_server
    monkeypatch.setattr(test_cli, "stop_server", lambda proc: seen.append(_group_members(proc.pid)) or stop(proc))
    with pytest.raises(AssertionError, match="did not come up"):
        test_cli.start_server(llama, "--tensor-parallel-size", "2", start_timeout=1.5)  # shorter than any start
    (members,) = seen
    assert members  # the server at least, and what it had started by then
    deadline = time.monotonic() + 10
    while _group_members(members[0]):  # SIGKILLed, gone once reaped
        assert time.monotonic() < deadline, f"still running: {_group_members(members[0])}"
        time.sleep(0.1)


def test_tp2_with_eagle_gives_the_greedy_tokens_of_one_rank(llama, reference, tmp_path):
    """The EAGLE head drafts on rank 0 (the hidden states every rank holds, the whole vocabulary gathered once at
    load); verify steps run on every rank, eagerly and through (stand-in) verify graphs that keep the hidden states,
    with the drafts' ids sent from the host (the engine's choice under TP) or broadcast from rank 0's device."""
    from brrr.models.eagle import new_head, save_head
    from brrr.pretrained import load
    from brrr.train.draft import EagleLoss
    from tests.engine.test_spec_eagle_engine import greedy_text

    # a head fitted a little to the target's greedy continuations of these prompts: some drafts are accepted, so the
    # tokens after an accepted draft show whether every rank saw its id
    model, by_length = load(str(llama), dtype="float32", device="cpu").model, {}
    for p in _prompts():
        by_length.setdefault(len(p), []).append(p)
    batches = [torch.tensor(greedy_text(model, group, 6)) for group in by_length.values()]
    head = new_head(model, seed=0)
    loss, opt = EagleLoss(head, model), torch.optim.AdamW(head.parameters(), lr=3e-3)
    for i in range(60):
        opt.zero_grad()
        loss(batches[i % len(batches)][:, :-1], batches[i % len(batches)][:, 1:]).backward()
        opt.step()
    save_head(head.eval(), tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    llm = LLM(str(llama), tensor_parallel_size=2, speculative_config={"method": "eagle", "num_speculative_tokens": 2,
                                                                      "model": str(tmp_path)}, **STRESS)
    try:
        draft = llm.engine.spec.proposer.target
        assert draft.model.embed_tokens.weight.shape == (VOCAB, llm.engine.model.full_config.hidden_size)
        assert not llm.engine.spec.device_drafts
        runs = [llm.generate(_prompts(), params, use_tqdm=False)]
        llm.engine.spec.device_drafts = True
        runs.append(llm.generate(_prompts(), params, use_tqdm=False))
        llm.engine.runner.capture_cuda_graphs(8, 64, capture=eager_capture)
        assert llm.engine.runner.verify_graphs.hidden
        runs.append(llm.generate(_prompts(), params, use_tqdm=False))
        stats = llm.engine.stats()
    finally:
        llm.engine.runner.shutdown()
    for outs in runs:
        assert [o.outputs[0].token_ids for o in outs] == reference[0]
        assert _close([o.outputs[0].logprobs for o in outs], reference[1])
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_verify_graph_steps"] > 0


def test_tp2_with_ngram_speculation_gives_the_greedy_tokens_of_one_rank(llama, reference):
    """Verify steps (several tokens of one sequence, rolled back on rejection) run through the sharded model."""
    prompts = _prompts()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(str(llama), tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **STRESS)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.engine.runner.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference[0]
    assert stats["spec_decode_num_draft_tokens"] > 0


def test_tp2_serves_a_lora_batch_like_one_rank(llama, tmp_path):
    """Three adapters over two slots (loads and evictions travel with the steps) and base rows in one batch: every
    rank holds its slices of each adapter (column-parallel projections B's rows, row-parallel ones A's columns,
    the update added before the all-reduce), and the tokens and log-probs are TP 1's, eagerly and through (stand-in)
    decode graphs."""
    from brrr.engine import LoRARequest
    from brrr.lora import LoraAdapter, LoraConfig, save_adapter
    from brrr.lora.serving import projection_shapes

    g = torch.Generator().manual_seed(0)
    shapes = projection_shapes(ModelConfig.from_dir(llama))
    requests = []
    for i, (r, kinds) in enumerate([(4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj")), (8, ("o_proj", "down_proj")), (2, ("v_proj", "up_proj"))]):
        weights = {n: (torch.randn(r, i_f, generator=g) * 0.3, torch.randn(o_f, r, generator=g) * 0.3)
                   for n, (i_f, o_f) in shapes.items() if n.rsplit(".", 1)[-1] in kinds}
        path = save_adapter(tmp_path / f"a{i}", LoraAdapter(LoraConfig(r=r, lora_alpha=8.0, target_modules=kinds),
                                                            weights))
        requests.append(LoRARequest(f"a{i}", i + 1, str(path)))
    prompts = _prompts()[:12]
    loras = [None if i % 4 == 3 else requests[i % 4] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    config = dict(STRESS, enable_lora=True, max_loras=2, max_lora_rank=8)

    def run(llm, capture=False):
        if capture:
            llm.engine.runner.capture_cuda_graphs(8, 64, capture=eager_capture)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    want = run(LLM(str(llama), **config))
    assert len({tuple(t) for t in want[0]}) > 8  # the adapters change the tokens
    llm = LLM(str(llama), tensor_parallel_size=2, **config)
    try:
        got = [run(llm), run(llm, capture=True)]
        loads = llm.engine.lora.loads
    finally:
        llm.engine.runner.shutdown()
    for tokens, logprobs in got:
        assert tokens == want[0] and _close(logprobs, want[1])
    assert loads > 3  # two slots for three adapters: evicted and loaded again


def test_tp2_guided_requests_equal_one_rank(tp2, llama):
    """Guided rows beside plain ones: rank 0 masks and samples; steps launched ahead queue their forward on every
    rank before the mask is known (the guided launch-ahead path, through stand-in graphs)."""
    from brrr import StructuredOutputsParams

    specs = [dict(regex="[ab]+c"), dict(choice=["yes", "no"]), None,
             dict(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=spec is None,
                             structured_outputs=None if spec is None else StructuredOutputsParams(**spec))
              for spec in specs] * 2
    prompts = _prompts()[:len(params)]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run(LLM(str(llama), **STRESS))
    runner = tp2.engine.runner
    runner.capture_cuda_graphs(8, 64, capture=eager_capture)
    forwards, real = [], runner.launch_forward
    runner.launch_forward = lambda batch, ids_from=None: forwards.append(ids_from is not None) or real(batch, ids_from)
    try:
        got = run(tp2)
    finally:
        del runner.launch_forward
    assert got == want
    assert any(forwards)  # guided steps launched ahead
