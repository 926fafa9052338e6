"""brrr vs transformers on tiny random mixture-of-experts and latent-attention models (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3): fp32 logits, 32 greedy tokens through brrr.load, and greedy tokens through the paged
engine under preemption, chunked prefill and prefix hits."""
import random

import pytest
import torch
from safetensors import safe_open

from brrr import LLM, SamplingParams, forward_logits, generate_tokens, load_model
from brrr.config import ModelConfig
from brrr.engine.model_runner import kv_bytes_per_block
from brrr.kernels import AttnMeta
from brrr.models.moe import SparseMoeBlock, StackedMoeBlock
from brrr.state_dict import hf_state_dict
from tests import hf_models
from tests.engine.test_engine import hf_greedy

PROMPT_LEN, NEW_TOKENS = 20, 32


@pytest.fixture(scope="module", params=sorted(hf_models.MOE_FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_models.build(request.param, vocab_size=320)  # room for the saved tokenizer's vocabulary (LLM loads it)
    hf_models.save(hf, path)
    hf_models.save_tokenizer(path)
    return hf, load_model(path, dtype=torch.float32), path


def test_loads_every_checkpoint_tensor_under_its_name(pair):
    hf, model, path = pair
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert set(hf_state_dict(model)) == names  # and saving writes the checkpoint's names back
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    cfg, layers = model.config, len(model.model.layers)
    assert sparse == [i for i in range(layers) if i not in cfg.dense_mlp_layers]
    assert sparse and (len(sparse) < layers or cfg.architecture == "MixtralForCausalLM")  # dense layers but Mixtral's
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # save_model's config.json describes the same model


def test_logits_and_greedy_tokens_match_transformers(pair):
    hf, model, _ = pair
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=gen)
    long = torch.randint(0, hf.config.vocab_size, (70,), generator=gen)  # past the YaRN models' 64 positions
    for ids in (prompt, long):
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]
        assert (forward_logits(model, ids.tolist()) - expected).abs().max().item() <= 1e-4
    ours = list(generate_tokens(model, prompt.tolist(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0)))
    assert ours == hf_greedy(hf, prompt.tolist(), NEW_TOKENS)
    # a training-style batch (no cache): MLA runs expanded, the cached paths above read the latent cache
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        batch = model.compute_logits(model(ids.flatten(), torch.arange(24).repeat(2), AttnMeta.causal([24] * 2, "cpu")))
    assert (batch - torch.cat([forward_logits(model, row.tolist()) for row in ids])).abs().max().item() <= 1e-5


def test_paged_engine_matches_transformers_under_preemption_chunking_and_prefix_hits(pair):
    hf, _, path = pair
    rng = random.Random(0)
    shared = [rng.randrange(320) for _ in range(40)]
    prompts = [(shared if i % 2 == 0 else []) + [rng.randrange(320) for _ in range(rng.randint(1, 40))]
               for i in range(8)]
    lengths = [rng.randint(4, 16) for _ in prompts]
    # 14 blocks of 8 tokens for 8 requests of up to 96 tokens: preemption; a 24-token budget: chunked prefill;
    # the serving form (packed attention projections, experts stacked for torch._grouped_mm)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=14, block_size=8, max_num_batched_tokens=24,
              max_num_seqs=8, pack_projections=True)
    assert any(isinstance(layer.mlp, StackedMoeBlock) for layer in llm.engine.model.model.layers)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths], use_tqdm=False)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert outs[i].outputs[0].token_ids == hf_greedy(hf, p, n), f"request {i}"
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    # the cache the engine allocated is what it sized itself by (brrr calc's count): for MLA the latent rows
    cfg = llm.engine.model.config
    block_bytes = sum(k[0].numel() + v[0].numel() for k, v in llm.engine.runner.kv_caches) * 4  # fp32
    assert block_bytes == kv_bytes_per_block(cfg, 8, torch.float32)
    if cfg.kv_lora_rank:
        assert block_bytes == cfg.num_layers * 8 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4

