"""The sampler follows the filtered distribution; stop strings cut text exactly; streaming never splits them."""
import asyncio
import math

import pytest
import torch

from brrr.config import EngineConfig
from brrr.engine import AsyncLLM, LLMEngine
from brrr.engine.sampler import SampleRow, sample
from brrr.pretrained import load
from brrr.sampling_params import SamplingParams
from tests import hf_models

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def expected(params: SamplingParams) -> torch.Tensor:
    """The filtered distribution written out step by step: top-k, then top-p on what is left, then min-p."""
    p = (LOGITS / params.temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    keep = set(order[: params.top_k or len(order)])
    p = torch.tensor([p[i] if i in keep else 0.0 for i in range(len(p))])
    p, mass, kept = p / p.sum(), 0.0, set()
    for i in order:
        if i in keep and (not kept or mass < params.top_p):
            kept.add(i)
            mass += p[i].item()
    kept = {i for i in kept if p[i] >= params.min_p * p.max()}
    q = torch.tensor([p[i] if i in kept else 0.0 for i in range(len(p))])
    return q / q.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
], ids=["plain", "top_k", "top_p", "min_p", "top_k+top_p"])
def test_samples_follow_the_filtered_distribution(params):
    draws = 6000
    logits = LOGITS.repeat(draws, 1)
    torch.manual_seed(0)
    rows = [SampleRow(params, seed=i if i % 2 else None) for i in range(draws)]  # seeded and unseeded rows
    counts = torch.bincount(torch.tensor(sample(logits, rows).tokens), minlength=len(LOGITS)).float()
    want = expected(params)
    assert counts[want == 0].sum() == 0, "sampled a filtered-out token"
    kept = want > 0
    stat = ((counts[kept] - draws * want[kept]) ** 2 / (draws * want[kept])).sum().item()
    assert stat < chi2_critical(int(kept.sum()) - 1)


def test_penalties_and_min_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits, [SampleRow(greedy, output_ids=[0])]).tokens == [1]
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [SampleRow(rep, prompt_ids=[0])]).tokens == [1]
    min_tok = SamplingParams(temperature=0, min_tokens=2)
    assert sample(logits, [SampleRow(min_tok, output_ids=[3], stop_ids=(0,))]).tokens == [1]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("with-tokenizer")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=256), path)
    return load(path, dtype="float32", device="cpu")


def _engine(pretrained):
    return LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(num_blocks=64), pretrained.eos_token_ids)


def _finish(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def test_stop_strings_cut_the_text_exactly(pretrained):
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = _finish(_engine(pretrained), "a", "def add(a, b):", base).outputs[0].text
    stop = full[12:15]
    assert len(stop) == 3 and stop in full
    cut = full[: full.index(stop)]
    for include, want in ((False, cut), (True, cut + stop)):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00never"],
                                include_stop_str_in_output=include)
        out = _finish(_engine(pretrained), "b", "def add(a, b):", params).outputs[0]
        assert (out.text, out.finish_reason) == (want, "stop")


def test_async_streaming_deltas_and_abort_frees_blocks(pretrained):
    engine = _engine(pretrained)
    llm = AsyncLLM(engine)
    full = _finish(_engine(pretrained), "ref", "def add(a, b):",
                   SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)).outputs[0].text
    stop = full[10:14]

    async def run():
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        deltas = [o.outputs[0].delta_text async for o in llm.generate("def add(a, b):", params)]
        streamed = "".join(deltas)
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        async for out in llm.generate("x = 1", long, request_id="cancel-me"):
            if len(out.outputs[0].token_ids) >= 3:
                break  # leaving the stream aborts the request
        with pytest.raises(ValueError, match="top_p"):
            async for _ in llm.generate("x", SamplingParams(top_p=0)):
                pass
        return streamed

    streamed = asyncio.run(run())
    assert streamed == full[: full.index(stop)]  # the deltas never leaked the start of the stop string
    for _ in range(100):  # the engine thread applies the abort on its next turn
        if not engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.02))
    llm.shutdown()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
