"""LLM, spelled as vLLM's: `from brrr import LLM, SamplingParams`; prompts as text, token ids, or prompt dicts."""
import pytest

from brrr import LLM, BrrrError, SamplingParams
from tests import hf_models


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llm-model")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=256), path)
    return LLM(str(path), dtype="float32", device="cpu", num_blocks=64)


def test_prompts_as_strings_ids_and_dicts_give_the_same_outputs(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    text = "def add(a, b):"
    ids = llm.tokenizer.encode(text)
    want = llm.generate(text, params, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 4
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert outs[1].prompt == text and outs[2].prompt is None
    (single,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert single.outputs[0].token_ids == want


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_ids": [1, 2]}, r"unknown field\(s\) 'prompt_ids'"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt' \\(text\\) or 'prompt_token_ids'"),
    ({"prompt": 5}, r"prompts\[0\]\['prompt'\] must be a string"),
    ({"prompt_token_ids": "12"}, r"prompts\[0\]\['prompt_token_ids'\] must be a list of token ids"),
    (3.5, "prompt must be a string or a list of token ids"),
])
def test_a_bad_prompt_is_named(llm, prompt, message):
    with pytest.raises(BrrrError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
