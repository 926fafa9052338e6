"""Guided decoding (structured_outputs) and logit_bias in the engine, with the shipped default model (a real
byte-level BPE vocabulary that can spell JSON; its free text is Python-ish code, nothing like the constraints):
every sampled output satisfies its constraint, neighbours are unaffected, preemption keeps the grammar state."""
import json
import math
import pickle
import re

import jsonschema
import pytest
import torch

from brrr import BrrrError, StructuredOutputsParams
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.engine.guided import compile_cache_info, compiler_for, fill_bitmask
from brrr.engine.guided.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from brrr.engine.sampler import SampleRow, sample
from brrr.pretrained import load
from brrr.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 99.5},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "minItems": 1,
                 "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["id", "zip"], "additionalProperties": False},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-\d{3}(\.[A-Z]{1,2})?"
CHOICES = ["red", "green", 'blue "navy"', "café au lait"]
PROMPTS = ["def main(", "import os\n", "x = ", "class A:\n    "]


@pytest.fixture(scope="module")
def pretrained():
    return load(None, dtype="float32", device="cpu")  # the shipped default model


def make_engine(pretrained, **config):
    config = {"num_blocks": 256, **config}
    return LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(**config), pretrained.eos_token_ids)


def run(engine, requests):
    """requests: [(prompt, params)] -> their finished outputs' completions, in order."""
    ids = [f"r{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, prompt, params, stream=False)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [done[rid] for rid in ids]


def guided(max_tokens=160, **spec):
    return dict(structured_outputs=StructuredOutputsParams(**spec), max_tokens=max_tokens, temperature=1.0)


def check(kind, completion):
    assert completion.finish_reason == "stop", completion
    text = completion.text
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


SPECS = {"json": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": REGEX},
         "choice": {"choice": CHOICES}}


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_sampled_output_satisfies_its_constraint(pretrained, kind):
    engine = make_engine(pretrained)
    requests = [(PROMPTS[seed % 4], SamplingParams(seed=seed, **guided(**SPECS[kind]))) for seed in range(50)]
    outs = [completion for (completion,) in run(engine, requests)]
    if kind == "json_object":  # no schema bounds its size: an object the model keeps growing runs out of tokens
        long = [c for c in outs if c.finish_reason == "length"]
        assert len(long) < 10 and all(c.text.startswith("{") for c in long)
        outs = [c for c in outs if c not in long]
    for completion in outs:
        check(kind, completion)
    assert len({c.text for c in outs}) > (1 if kind == "choice" else 10)  # sampled, not one forced string


@pytest.mark.parametrize("grammar, pattern", [
    ('start: item ("," item)?\nitem: /[a-z]{1,4}/ | NUMBER\nNUMBER: /[0-9]{1,3}/',
     r"([a-z]{1,4}|[0-9]{1,3})(,([a-z]{1,4}|[0-9]{1,3}))?"),
    ('root ::= ("yes" | "no") " " num\nnum ::= [0-9] [0-9]? "." [0-9]', r"(yes|no) [0-9][0-9]?\.[0-9]"),
], ids=["lark", "gbnf"])
def test_grammar_outputs_are_sentences_of_it(pretrained, grammar, pattern):
    engine = make_engine(pretrained)
    outs = run(engine, [(PROMPTS[s % 4], SamplingParams(seed=s, **guided(40, grammar=grammar))) for s in range(20)])
    for (completion,) in outs:
        assert completion.finish_reason == "stop" and re.fullmatch(pattern, completion.text), completion.text


def test_json_schema_given_as_text_and_the_compile_cache(pretrained):
    engine = make_engine(pretrained)
    before = compile_cache_info()
    text = json.dumps(SCHEMA, indent=2)
    outs = run(engine, [("x = ", SamplingParams(seed=s, **guided(json=text))) for s in range(3)]
               + [("x = ", SamplingParams(seed=9, **guided(json=SCHEMA)))])
    for (completion,) in outs:
        check("json", completion)
    after = compile_cache_info()
    assert after["misses"] - before["misses"] <= 1  # one schema, however spelled: compiled once at most
    assert after["hits"] - before["hits"] >= 7  # each request checked, each sequence's matcher copied


def test_n_samples_each_follow_the_grammar_on_their_own(pretrained):
    engine = make_engine(pretrained)
    (outs,) = run(engine, [("def main(", SamplingParams(n=6, seed=3, **guided(json=SCHEMA)))])
    assert len(outs) == 6
    for completion in outs:
        check("json", completion)
    assert len({c.text for c in outs}) > 1


def test_unguided_neighbours_get_the_same_tokens(pretrained):
    plain = [("import os\n", SamplingParams(max_tokens=24, seed=11, ignore_eos=True)),
             ("x = ", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
             ("class A:\n    ", SamplingParams(max_tokens=24, seed=12, top_p=0.9, ignore_eos=True))]
    alone = run(make_engine(pretrained), plain)
    mixed_requests = [plain[0], ("def main(", SamplingParams(seed=1, **guided(json=SCHEMA))), plain[1],
                      ("x = ", SamplingParams(seed=2, **guided(regex=REGEX))), plain[2],
                      ("y = ", SamplingParams(seed=3, logit_bias={5: 3.0}, max_tokens=10))]
    mixed = run(make_engine(pretrained), mixed_requests)
    assert [m[0].token_ids for m in (mixed[0], mixed[2], mixed[4])] == [a[0].token_ids for a in alone]
    check("json", mixed[1][0])
    check("regex", mixed[3][0])


def test_preemption_and_chunked_prefill_keep_outputs_valid(pretrained):
    # 12 blocks of 16 tokens for 8 sequences of up to ~200 tokens: decodes preempt each other and recompute;
    # a 32-token budget chunks the long prompts
    engine = make_engine(pretrained, num_blocks=14, block_size=16, max_num_batched_tokens=32, max_num_seqs=8)
    long_prompt = "def parse(text):\n    " * 6
    kinds = ["json", "regex", "choice", "json"] * 2
    requests = [(long_prompt if i % 2 else PROMPTS[i % 4], SamplingParams(seed=i, **guided(**SPECS[k])))
                for i, k in enumerate(kinds)]
    # n = 3 with the batch full: forks wait without blocks and are recomputed, each with its own grammar state
    requests.append(("x = ", SamplingParams(seed=99, n=3, **guided(json=SCHEMA))))
    outs = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for kind, (completion,) in zip(kinds, outs):
        check(kind, completion)
    assert len(outs[-1]) == 3
    for completion in outs[-1]:
        check("json", completion)


def test_grammar_completion_ends_the_sample_with_its_text(pretrained):
    engine = make_engine(pretrained)
    params = [SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(choice=["café"])),
              SamplingParams(temperature=0, ignore_eos=True, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex="ab?c"))]
    cafe, abc = run(engine, [("x = ", p) for p in params])
    assert (cafe[0].text, cafe[0].finish_reason) == ("café", "stop")
    assert pretrained.tokenizer.decode(cafe[0].token_ids) == "café"  # no EOS appended: the grammar ended it
    assert abc[0].text in ("ac", "abc") and abc[0].finish_reason == "stop"


def test_guided_logprobs_are_of_the_masked_distribution(pretrained):
    engine = make_engine(pretrained)
    spec = StructuredOutputsParams(choice=["red", "green"])
    first_mask = fill_bitmask([compiler_for(pretrained.tokenizer, 8192, pretrained.eos_token_ids).matcher(spec)], 8192)
    allowed = {t for t in range(8192) if (first_mask[0, t // 32].item() >> (t % 32)) & 1}
    assert 2 <= len(allowed) <= 10  # "r", "red", "g", "green", ...: the first tokens of the two choices
    ((out,),) = run(engine, [("x = ", SamplingParams(temperature=0, logprobs=20, structured_outputs=spec))])
    first = out.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp > float("-inf")}
    assert set(finite) == allowed  # every allowed token listed (top 20), nothing else with any mass
    assert abs(sum(math.exp(lp) for lp in finite.values()) - 1) < 1e-4


def test_pipelined_guided_decode_equals_step_by_step(pretrained):
    """With graphs (eager stand-ins on CPU), a guided step's forward is queued before the previous step's tokens are
    read and its sampling after the matchers advance: every sample equals the step-by-step engine's, stays valid,
    grammars that complete mid-flight end cleanly, and unguided neighbours are untouched."""
    from tests.engine.test_graph_inputs import EagerReplay

    requests = [("def main(", SamplingParams(seed=1, **guided(json=SCHEMA))),
                ("x = ", SamplingParams(seed=2, **guided(regex=REGEX))),
                ("import os\n", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                ("class A:\n    ", SamplingParams(seed=3, **guided(choice=CHOICES))),
                ("x = ", SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True))]
    outs, guided_ahead = [], {"n": 0}
    for graphs in (False, True):
        engine = make_engine(pretrained, max_num_seqs=5)
        if graphs:
            runner = engine.runner
            runner.capture_cuda_graphs(5, 16, capture=lambda step, pool: (g := EagerReplay(step), g.logits))
            real = runner.launch_forward

            def counting(batch, ids_from=None, real=real):
                guided_ahead["n"] += any(s.request.params.structured_outputs is not None for s, _ in batch.items)
                return real(batch, ids_from)
            runner.launch_forward = counting
        outs.append([o[0] for o in run(engine, requests)])
    plain, pipelined = outs
    assert guided_ahead["n"] > 10
    for a, b in zip(plain, pipelined):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    for kind, i in (("json", 0), ("regex", 1), ("choice", 3)):
        check(kind, pipelined[i])


def test_a_token_the_grammar_rejects_ends_only_that_sample(pretrained, monkeypatch, caplog):
    """Should a backend ever let through a token its grammar rejects, that sample ends ("abort", logged) and the
    engine goes on: here the mask is switched off so the model's first token breaks the regex."""
    import brrr.engine.sampler as sampler

    engine = make_engine(pretrained)
    monkeypatch.setattr(sampler, "constrain", lambda logits, rows, bitmask=None: logits)
    spec = StructuredOutputsParams(regex="zqzqzq")
    bad, fine = run(engine, [("def main(", SamplingParams(temperature=0, structured_outputs=spec)),
                             ("def main(", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))])
    assert bad[0].finish_reason == "abort" and len(bad[0].token_ids) == 1
    assert "the grammar rejected token" in caplog.text
    assert fine[0].finish_reason == "length" and len(fine[0].token_ids) == 5


def test_logit_bias_forces_and_bans_tokens(pretrained):
    engine = make_engine(pretrained)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ((base,),) = run(engine, [("def main(", greedy)])
    first = base.token_ids[0]
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={1234: 100})
    banned = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={str(first): -1e6})  # clamped
    assert banned.logit_bias == {first: -100.0}
    (f,), (b,) = run(engine, [("def main(", forced), ("def main(", banned)])
    assert f.token_ids == [1234] * 4
    assert first not in b.token_ids[:1]
    # sampled rows too, beside unbiased ones, in one batch
    rows = [SampleRow(SamplingParams(seed=i, logit_bias={3: 100.0}), seed=i) for i in range(4)] + [
        SampleRow(SamplingParams(temperature=0))]
    logits = torch.zeros(5, 16)
    logits[4, 9] = 1.0
    assert sample(logits, rows).tokens == [3, 3, 3, 3, 9]


@pytest.mark.parametrize("kwargs, message", [
    ({"structured_outputs": StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}})},
     r"^structured_outputs\.json: .*nope"),
    ({"structured_outputs": StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1})},
     r"^structured_outputs\.json: .*minimum"),
    ({"structured_outputs": StructuredOutputsParams(regex="(a")}, r"^structured_outputs\.regex: .*unclosed group"),
    ({"structured_outputs": StructuredOutputsParams(regex="(?=a)b")}, r"^structured_outputs\.regex: .*look-around"),
    ({"structured_outputs": StructuredOutputsParams(grammar="start: foo")}, r"^structured_outputs\.grammar: .*foo"),
    ({"logit_bias": {8192: 1.0}}, r"^logit_bias: token id 8192 is outside the vocabulary \[0, 8192\)"),
    ({"logit_bias": {-1: 1.0}}, r"^logit_bias: token id -1 is outside the vocabulary"),
])
def test_a_bad_constraint_fails_the_request_naming_its_field(pretrained, kwargs, message):
    engine = make_engine(pretrained)
    with pytest.raises(BrrrError, match=message):
        engine.make_request("bad", "x = ", SamplingParams(**kwargs))


@pytest.mark.parametrize("make, message", [
    (lambda: StructuredOutputsParams(), r"^structured_outputs: exactly one of .* got none"),
    (lambda: StructuredOutputsParams(json={}, regex="a"), r"^structured_outputs: exactly one .* got json, regex"),
    (lambda: StructuredOutputsParams(choice=[]), r"^structured_outputs\.choice must be a non-empty list"),
    (lambda: StructuredOutputsParams(json="{not json"), r"^structured_outputs\.json: not valid JSON"),
    (lambda: StructuredOutputsParams(json="[1]"), r"^structured_outputs\.json: a JSON schema must be an object"),
    (lambda: SamplingParams(structured_outputs={"json": {}}), r"^structured_outputs must be a StructuredOutputsParams"),
    (lambda: SamplingParams(logit_bias={"a": 1}), r"^logit_bias: token id 'a' is not an integer"),
    (lambda: SamplingParams(logit_bias={1: float("nan")}), r"^logit_bias\[1\] must be a finite number"),
])
def test_a_malformed_constraint_is_named(make, message):
    with pytest.raises(BrrrError, match=message):
        make()


def test_params_with_a_constraint_cross_the_engine_process_pipe():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), logit_bias={3: 1.5})
    again = pickle.loads(pickle.dumps(params))
    assert again.structured_outputs == params.structured_outputs and again.logit_bias == {3: 1.5}


def test_an_engine_without_a_tokenizer_refuses_a_grammar(pretrained):
    engine = LLMEngine(pretrained.model, None, EngineConfig(num_blocks=16))
    with pytest.raises(BrrrError, match="^structured_outputs: this engine has no tokenizer"):
        engine.make_request("r", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


@pytest.mark.parametrize("vocab", [37, 64, 8192])
def test_bitmask_application_matches_the_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [4, 0, 2]
    got = apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(got, apply_token_bitmask_ref(logits, bitmask, rows))
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a grammar untouched
    full = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
    assert torch.equal(apply_token_bitmask(logits, full), apply_token_bitmask_ref(logits, full))


def test_offline_llm_generate_with_a_schema():
    from brrr import LLM

    llm = LLM(dtype="float32", device="cpu", num_blocks=128)  # the shipped default model
    params = [SamplingParams(seed=s, **guided(json=SCHEMA)) for s in range(4)]
    outs = llm.generate(["def main(", "x = ", "import os\n", "y = "], params, use_tqdm=False)
    for out in outs:
        check("json", out.outputs[0])


def test_async_llm_streams_a_guided_request_and_refuses_a_bad_one(pretrained):
    """The server's path: requests checked (the grammar compiled) on the caller's side, run by the engine loop."""
    import asyncio

    from brrr.engine import AsyncLLM

    llm = AsyncLLM(make_engine(pretrained))

    async def go():
        params = SamplingParams(seed=5, **guided(json=SCHEMA))
        deltas = [o.outputs[0] async for o in llm.generate("x = ", params)]
        with pytest.raises(BrrrError, match=r"^structured_outputs\.regex: "):
            llm.make_request("bad", "x = ", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
        return deltas

    try:
        deltas = asyncio.run(go())
    finally:
        llm.shutdown()
    final = deltas[-1]
    check("json", final)
    assert "".join(d.delta_text for d in deltas) == final.text
