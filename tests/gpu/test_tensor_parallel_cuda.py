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


@pytest.mark.parametrize("feature", ["ngram", "lora"])
def test_tp2_verify_graphs_and_lora_on_nccl_match_one_gpu(tmp_path, feature):
    """The one runner's other graphs on every rank: n-gram verify steps replayed from the verify graphs both ranks
    captured (NCCL inside), and a batch of two adapters and base rows over sharded LoRA slots through the decode
    graphs; greedy tokens equal one GPU's."""
    from brrr.config import ModelConfig
    from brrr.engine import LoRARequest
    from brrr.lora import LoraAdapter, LoraConfig, save_adapter
    from brrr.lora.serving import projection_shapes

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = tmp_path / "model"
    hf_models.save_tokenizer(model_dir)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=321), model_dir, sharded=True)
    prompts = [[1 + i, 5, 9, 30 + i] * (1 + i % 4) for i in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    args = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.05, max_num_batched_tokens=64,
                pack_projections=False, cuda_graphs=True)
    loras = None
    if feature == "ngram":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    else:
        g = torch.Generator().manual_seed(0)
        requests = []
        for i, r in enumerate((4, 8)):
            weights = {n: (torch.randn(r, i_f, generator=g) * 0.3, torch.randn(o_f, r, generator=g) * 0.3)
                       for n, (i_f, o_f) in projection_shapes(ModelConfig.from_dir(model_dir)).items()}
            adapter = LoraAdapter(LoraConfig(r=r, lora_alpha=8.0, target_modules=tuple(sorted({
                n.rsplit(".", 1)[-1] for n in weights}))), weights)
            requests.append(LoRARequest(f"a{i}", i + 1, str(save_adapter(tmp_path / f"a{i}", adapter))))
        loras = [None if i % 3 == 2 else requests[i % 3] for i in range(len(prompts))]
        args.update(enable_lora=True, max_loras=2, max_lora_rank=8)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]

    one = LLM(str(model_dir), **args)
    want = run(one)
    del one
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), tensor_parallel_size=2, **args)
    try:
        got = run(llm)
        stats = llm.engine.stats()
    finally:
        llm.engine.runner.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert got == want
    if feature == "ngram":
        assert stats["spec_verify_graph_steps"] > 0
