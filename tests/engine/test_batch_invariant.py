"""The engine in the batch-invariant mode: one prompt's sampled-token logprobs are the same bits when it runs alone,
beside 7 other prompts, in chunked prefill, after a prefix-cache hit, and in a trainer's full-sequence forward under
autograd (`torch.equal`). With the mode off the same comparisons differ, so these tests can fail."""
import copy

import pytest
import torch

from brrr import LLM, SamplingParams
from brrr.config import EngineConfig
from brrr.engine import LLMEngine, LoRARequest
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.kernels.batch_invariant import batch_invariant
from brrr.kernels.log_softmax import log_softmax
from brrr.loader import load_model
from brrr.lora import save_adapter
from brrr.serving_form import prepare_for_serving
from tests import hf_models
from tests.lora.test_serving_engine import random_adapter

VOCAB = 320
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, seed=5, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch-invariant-model")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=VOCAB), path)
    return path


def _prompts():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (37,), generator=g).tolist()  # two full cache blocks and a partial one
    others = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (7,), generator=g)]
    return prompt, others


def _logprobs(output):
    o = output.outputs[0]
    return o.token_ids, torch.tensor([lp[t] for lp, t in zip(o.logprobs, o.token_ids)], dtype=torch.float32)


def _trainer_logprobs(model_dir, dtype, prompt, tokens, invariant: bool, device="cpu"):
    """What a trainer recomputes: one forward over prompt + completion, with gradients, then log-softmax."""
    model = load_model(model_dir, dtype=dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.tensor(prompt + tokens, device=device)
    with batch_invariant() if invariant else torch.enable_grad():
        positions = torch.arange(len(ids), device=device)
        logits = model.compute_logits(model(ids, positions, AttnMeta.causal([len(ids)], device)))
        lp = log_softmax(logits)
    assert lp.requires_grad
    rows = torch.arange(len(prompt) - 1, len(ids) - 1, device=device)
    return lp[rows, torch.tensor(tokens, device=device)].detach().cpu()


def _every_way(model_dir, dtype, invariant: bool, device="cpu"):
    """{way: (tokens, logprobs)} for the prompt alone, in a batch, chunked, after a prefix hit, and the trainer's."""
    prompt, others = _prompts()
    name = str(dtype).removeprefix("torch.")
    args = dict(dtype=name, device=device, num_blocks=96, batch_invariant=invariant)
    llm = LLM(str(model_dir), **args)
    ways = {"alone": _logprobs(llm.generate([prompt], PARAMS, use_tqdm=False)[0])}
    blocks = llm.engine.scheduler.block_manager
    hits = blocks.prefix_hits
    ways["prefix hit"] = _logprobs(llm.generate([prompt], PARAMS, use_tqdm=False)[0])
    assert blocks.prefix_hits - hits >= 32  # its two full blocks came from the cache
    ways["batch of 8"] = _logprobs(llm.generate([prompt] + others, PARAMS, use_tqdm=False)[0])
    chunked = LLM(str(model_dir), max_num_batched_tokens=8, **args)
    ways["chunked"] = _logprobs(chunked.generate([prompt], PARAMS, use_tqdm=False)[0])
    tokens = ways["alone"][0]
    ways["trainer"] = (tokens, _trainer_logprobs(model_dir, dtype, prompt, tokens, invariant, device))
    return ways


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_bit_identical_in_the_mode(model_dir, dtype):
    ways = _every_way(model_dir, dtype, invariant=True)
    tokens, want = ways.pop("alone")
    for way, (got_tokens, got) in ways.items():
        assert got_tokens == tokens, way
        assert torch.equal(got, want), f"{way}: max |delta| {(got - want).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_mode_the_same_comparisons_differ(model_dir, dtype):
    ways = _every_way(model_dir, dtype, invariant=False)
    tokens, want = ways.pop("alone")
    deltas = {way: (got - want).abs().max().item() for way, (t, got) in ways.items() if t == tokens}
    assert max(deltas.values()) > 0, deltas


def test_a_packed_model_is_refused(model_dir):
    model = prepare_for_serving(load_model(model_dir, dtype=torch.float32), EngineConfig(pack_projections=True))
    with pytest.raises(BrrrError, match="batch_invariant: this model has quantized or packed projections"):
        prepare_for_serving(model, EngineConfig(batch_invariant=True))


def _lora_logprobs(base, items, invariant: bool):
    engine = LLMEngine(copy.deepcopy(base), None, EngineConfig(num_blocks=64, enable_lora=True, max_loras=2,
                                                               batch_invariant=invariant))
    for i, (prompt, lora) in enumerate(items):
        engine.add_request(str(i), prompt, PARAMS, stream=False, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step())
    return _logprobs(done["0"])[1]


def test_lora_rows_are_invariant_across_the_adapters_beside_them(model_dir, tmp_path):
    """The serving slots' shrink and expand run through the invariant matmul too: a request's adapter rows give the
    same bits alone and beside rows of another adapter and of the base."""
    base = load_model(model_dir, dtype=torch.float32)
    loras = [LoRARequest(f"a{i}", i + 1, str(save_adapter(tmp_path / f"a{i}", random_adapter(base, 10 + i))))
             for i in range(2)]
    prompt, others = _prompts()
    mixed = [(prompt, loras[0]), (others[0], loras[1]), (others[1], None), (others[2], loras[0])]
    deltas = {}
    for invariant in (True, False):
        alone = _lora_logprobs(base, mixed[:1], invariant)
        deltas[invariant] = (alone - _lora_logprobs(base, mixed, invariant)).abs().max().item()
    assert deltas[True] == 0 and deltas[False] > 0, deltas


def test_a_sharded_engine_is_refused():
    with pytest.raises(BrrrError, match="batch_invariant runs on one device: tensor_parallel_size must be 1"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
