"""Disaggregated prefill and decode on CPU (gloo, fp32): prefill instances in processes of their own send each
prompt's KV blocks to the decode instance, which gives one co-located instance's greedy tokens and log-probs; a
killed prefill instance fails the requests it holds with its exit reason while the decode instance finishes the
others (and prefills new ones itself); bad flags fail before any weight loads."""
import os
import re
import signal
import time

import pytest
import torch

from brrr import LLM, BrrrError, SamplingParams
from brrr.config import EngineConfig
from brrr.config.disaggregation import check_devices, parse_disaggregate
from brrr.sampling_params import StructuredOutputsParams
from tests import hf_models

VOCAB = 321
LOGPROB_TOLERANCE = 1e-4
GRAMMAR = "(ab|ba)+c"
# a 16-block pool of 4-token blocks for 20 requests: the decode instance preempts (and recomputes), requests wait
# for room before their KV is pulled; a 24-token budget: prompts prefill in chunks; shared starts: prefix hits
STRESS = dict(dtype="float32", device="cpu", block_size=4, num_blocks=16, max_num_batched_tokens=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg")
    hf_models.save_tokenizer(path)
    return hf_models.save(hf_models.build("llama3-rope", vocab_size=VOCAB), path)


def _prompts():
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    return [shared + [20 + i, 30 + i] if i % 2 else [1 + i, 5, 40 + i] * (1 + i % 3) for i in range(20)]


def _params():
    """Mostly greedy with log-probs; one request its first token ends (max_tokens 1, answered by the prefill
    instance alone), one with prompt log-probs, one with two samples (prefilled on the decode instance), one seeded
    sample with penalties (they read the first token), one under a grammar (its matcher past the first token)."""
    greedy = dict(temperature=0, ignore_eos=True, logprobs=3)
    params = [SamplingParams(max_tokens=6, **greedy) for _ in range(20)]
    params[3] = SamplingParams(max_tokens=1, **greedy)
    params[4] = SamplingParams(max_tokens=5, prompt_logprobs=2, **greedy)
    params[5] = SamplingParams(max_tokens=4, n=2, temperature=0.8, seed=3, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=6, temperature=0.9, seed=11, presence_penalty=1.5, repetition_penalty=1.3,
                               ignore_eos=True)
    params[7] = SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                               structured_outputs=StructuredOutputsParams(regex=GRAMMAR))
    return params


def _run(llm):
    return llm.generate(_prompts(), _params(), use_tqdm=False)


def _same(outs, want):
    for a, b in zip(outs, want):
        assert a.error is None
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            for pa, pb in zip(x.logprobs or [], y.logprobs or []):
                assert pa.keys() == pb.keys() and all(abs(pa[t] - pb[t]) <= LOGPROB_TOLERANCE for t in pa)
        if b.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
            assert all(abs(pa[t] - pb[t]) <= LOGPROB_TOLERANCE for pa, pb in zip(a.prompt_logprobs[1:],
                                                                                  b.prompt_logprobs[1:]) for t in pa)


@pytest.fixture(scope="module")
def reference(model_dir):
    outs = _run(LLM(str(model_dir), **STRESS))
    assert re.fullmatch(GRAMMAR, outs[7].outputs[0].text)
    return outs


def test_two_prefill_instances_and_a_decode_instance_give_one_instances_tokens(model_dir, reference):
    llm = LLM(str(model_dir), disaggregate="prefill=0,2,decode=1", **STRESS)
    try:
        _same(_run(llm), reference)
        stats = llm.engine.stats()
        # 18 of 20 went through a prefill instance (max_tokens 1 ended at its first token; n=2 prefilled here)
        assert stats["kv_transfers"] == 18
        assert stats["kv_transfer_bytes"] > 0 and stats["kv_transfer_seconds"] > 0
        assert stats["num_preemptions"] > 0  # the decode pool overflowed: recomputed here, still the same tokens
        assert stats["prefill_instances_alive"] == 2
        llm.engine.block_manager.check_invariants([])  # every block came back
        _same(_run(llm), reference)  # again, now with prefix-cache hits on the prefill instances
    finally:
        llm.engine.shutdown()
    assert all(not inst.proc.is_alive() for inst in llm.engine.instances)


def test_a_killed_prefill_instance_fails_its_requests_and_decoding_goes_on(model_dir, reference):
    llm = LLM(str(model_dir), disaggregate="prefill=0,decode=1", **STRESS)
    engine, prompts, params = llm.engine, _prompts(), _params()
    try:
        engine.add_request("decoding", prompts[0], params[0], stream=False)
        while not engine.scheduler.running:  # its KV has landed: it decodes here
            assert not engine.step()
        instance = engine.instances.instances[0]
        engine.add_request("lost-1", prompts[1], params[1], stream=False)
        engine.add_request("lost-2", prompts[2], params[2], stream=False)
        os.kill(instance.proc.pid, signal.SIGKILL)
        instance.proc.join(10)
        finished, start = {}, time.monotonic()
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
            assert time.monotonic() - start < 30
        assert finished["decoding"].error is None
        assert finished["decoding"].outputs[0].token_ids == reference[0].outputs[0].token_ids
        for lost in ("lost-1", "lost-2"):
            assert "prefill instance 0" in finished[lost].error and "exited with code -9" in finished[lost].error
        assert engine.stats()["prefill_instances_alive"] == 0
        engine.block_manager.check_invariants([])
        # with no prefill instance left, the decode instance prefills new prompts itself
        out = llm.generate([prompts[6]], params[6], use_tqdm=False)[0]
        assert out.error is None and out.outputs[0].token_ids == reference[6].outputs[0].token_ids
    finally:
        engine.shutdown()


def _freeze(pid: int) -> None:
    """SIGSTOP, then wait until the kernel has stopped the process: kill() returns before that, and a pull sent
    in between was served (the test's own race, seen as a transfer that completed)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def test_a_hung_prefill_instance_is_stopped_and_fails_its_requests(model_dir, reference, monkeypatch):
    from brrr.distributed import disagg_engine

    monkeypatch.setattr(disagg_engine, "PREFILL_SILENCE_S", 1.0)
    llm = LLM(str(model_dir), disaggregate="prefill=0,decode=1", **STRESS)
    engine, prompts, params = llm.engine, _prompts(), _params()
    instance = engine.instances.instances[0]
    try:
        engine.add_request("decoding", prompts[0], params[0], stream=False)
        while not engine.scheduler.running:
            engine.step()
        _freeze(instance.proc.pid)  # alive, silent
        engine.add_request("stuck", prompts[1], params[1], stream=False)
        finished, start = {}, time.monotonic()
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
            assert time.monotonic() - start < 20
        assert finished["decoding"].outputs[0].token_ids == reference[0].outputs[0].token_ids
        assert "prefill instance 0" in finished["stuck"].error and "answered nothing for" in finished["stuck"].error
        instance.proc.join(5)
        assert instance.proc.exitcode == -signal.SIGKILL  # stopped for good, not left frozen
    finally:
        engine.shutdown()


def test_a_transfer_that_never_comes_times_out(model_dir, reference, monkeypatch):
    import datetime

    from brrr.distributed import disagg_transfer

    monkeypatch.setattr(disagg_transfer, "TIMEOUT", datetime.timedelta(seconds=1))
    llm = LLM(str(model_dir), disaggregate="prefill=0,decode=1", **STRESS)
    engine, prompts, params = llm.engine, _prompts(), _params()
    instance = engine.instances.instances[0]
    try:
        finished = {}  # "decoding" may finish while "stuck" is still on its way to "ready"
        engine.add_request("decoding", prompts[0], params[0], stream=False)
        while not engine.scheduler.running:
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.core._pull = lambda: None  # hold the next request at "ready" ...
        engine.add_request("stuck", prompts[1], params[1], stream=False)
        while "stuck" not in engine.ready:
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        _freeze(instance.proc.pid)  # ... freeze its instance, then pull: the send never comes
        del engine.core._pull
        start = time.monotonic()
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
            assert time.monotonic() - start < 20
        assert finished["decoding"].outputs[0].token_ids == reference[0].outputs[0].token_ids
        error = finished["stuck"].error
        assert "the KV transfer from prefill instance 0" in error and "Timed out" in error
        assert not engine.in_transfer and engine.stats()["prefill_instances_alive"] == 0
        engine.block_manager.check_invariants([])
    finally:
        engine.shutdown()


def test_aborted_requests_free_their_blocks_on_both_sides(model_dir):
    llm = LLM(str(model_dir), disaggregate="prefill=0,decode=1", **STRESS)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        for i, prompt in enumerate(_prompts()[:6]):
            engine.add_request(f"r{i}", prompt, params, stream=False)
        for step in range(40):  # abort each request at a different phase: prefilling, ready, pulled, decoding
            engine.step()
            if step % 3 == 0 and engine.requests:
                engine.abort(next(iter(engine.requests)))
        while engine.has_unfinished_requests():  # until a cancelled request's KV in flight has landed too
            engine.step()
        assert not engine.in_transfer and not engine.routed
        engine.block_manager.check_invariants([])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        # the prefill instance freed its side too: a prompt needing its whole pool still goes through there
        big = list(range(1, 4 * 16 - 8))
        out = llm.generate([big], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.error is None and engine.stats()["kv_transfers"] >= 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("value, message", [
    ("prefill=0,decode=0", "device 0 is in both prefill and decode"),
    ("prefill=0", "decode missing"),
    ("prefill=0,decode=1,2", "decode takes one device"),
    ("prefill=x,decode=1", "prefill takes device ids"),
    ("encode=0,decode=1", "unknown role 'encode'"),
])
def test_bad_disaggregate_spellings_name_the_flag(model_dir, value, message):
    start = time.monotonic()
    with pytest.raises(BrrrError, match=rf"--disaggregate .*{message}"):
        LLM(str(model_dir), disaggregate=value, **STRESS)
    assert time.monotonic() - start < 5  # refused before any process started or weight loaded


@pytest.mark.parametrize("extra, flag", [
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "--speculative-config"),
])
def test_unsupported_combinations_are_refused(extra, flag):
    with pytest.raises(BrrrError, match=rf"--disaggregate .* cannot be combined with {flag}"):
        EngineConfig(disaggregate="prefill=0,decode=1", **extra)


def test_more_gpus_than_present_and_a_device_index_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    d = parse_disaggregate("prefill=0,1,decode=2")
    with pytest.raises(BrrrError, match=r"--disaggregate .*GPU 2 does not exist; this machine has 2 CUDA GPU"):
        check_devices(d, torch.device("cuda"))
    with pytest.raises(BrrrError, match=r"--disaggregate .*use --device cuda \(not cuda:1\)"):
        check_devices(parse_disaggregate("prefill=0,decode=1"), torch.device("cuda", 1))


def test_a_plain_engine_refuses_the_flag_rather_than_ignoring_it(model_dir):
    from brrr.engine import LLMEngine
    from brrr.pretrained import load

    pretrained = load(model_dir, dtype="float32", device="cpu")
    with pytest.raises(BrrrError, match="disaggregate needs its prefill instances"):
        LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(disaggregate="prefill=0,decode=1"))
