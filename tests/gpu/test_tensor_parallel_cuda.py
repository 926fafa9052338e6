"""Tensor-parallel serving on CUDA (NCCL, one GPU per rank): TP = 2 gives TP = 1's greedy tokens in fp32,
eagerly and through decode graphs captured on both ranks with the NCCL collectives inside; the KV
cache is sized by every rank's profiling pass. Needs two GPUs."""
import gc

import pytest
import torch

from brrr import LLM, SamplingParams
from tests import hf_models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_tp2_on_nccl_matches_one_gpu(tmp_path, cuda_graphs):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf_models.save_tokenizer(tmp_path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=321), tmp_path, sharded=True)
    prompts = [[1 + i, 5, 9, 30 + i] * (1 + i % 4) for i in range(20)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    args = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.05, max_num_batched_tokens=64,
                pack_projections=False, cuda_graphs=cuda_graphs)
    one = LLM(str(tmp_path), **args)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one  # its KV pool counts against rank 0's gpu_memory_utilization share otherwise
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **args)
    try:
        assert llm.engine.block_manager.num_blocks > 100  # profiled on both GPUs, the smaller taken
        assert bool(llm.engine.runner.graphs) == cuda_graphs  # every rank captured, NCCL inside
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.runner.shutdown()
        del llm  # the next case sizes its pools from what is free
        gc.collect()
        torch.cuda.empty_cache()
    assert got == want
