"""Disaggregated prefill and decode on CUDA (NCCL point-to-point, prefill on GPU 0, decode on GPU 1 with its decode
graphs): the greedy tokens of one GPU, and a killed prefill instance fails its requests without hanging the decode
instance. Needs two GPUs."""
import gc
import os
import signal
import time

import pytest
import torch

from brrr import LLM, SamplingParams
from tests import hf_models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_disaggregated_on_nccl_matches_one_gpu_and_survives_its_prefill_instance(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_models.save_tokenizer(tmp_path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=321), tmp_path)
    prompts = [[1 + i, 5, 9, 30 + i] * (1 + i % 4) for i in range(20)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    args = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.05, max_num_batched_tokens=64,
                pack_projections=False)
    one = LLM(str(tmp_path), **args)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path), disaggregate="prefill=0,decode=1", **args)
    engine = llm.engine
    try:
        assert engine.runner.device == torch.device("cuda", 1) and engine.runner.graphs
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert engine.stats()["kv_transfers"] == 20
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        engine.add_request("decoding", prompts[0], long, stream=False)
        while not engine.scheduler.running:
            engine.step()
        engine.add_request("lost", prompts[1], params, stream=False)
        os.kill(engine.instances.instances[0].proc.pid, signal.SIGKILL)
        finished, start = {}, time.monotonic()
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            assert time.monotonic() - start < 60
        assert finished["decoding"].error is None and len(finished["decoding"].outputs[0].token_ids) == 200
        assert "prefill instance 0" in finished["lost"].error
    finally:
        engine.shutdown()
