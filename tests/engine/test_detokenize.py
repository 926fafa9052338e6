"""The engine's text is exactly the decoded tokens: a tail of incomplete UTF-8 is flushed when a sequence ends."""
import pytest

from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.pretrained import load
from brrr.sampling_params import SamplingParams
from brrr.tokenizer import IncrementalDecoder
from tests import hf_models


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("flush-model")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320), path)
    return load(path, dtype="float32", device="cpu")


def test_decoder_flush_returns_the_held_back_tail(pretrained):
    tok = pretrained.tokenizer
    ids = tok.encode("caf\u00e9 \u2603", add_special_tokens=False)  # byte-level: the snowman is 3 byte tokens
    decoder = IncrementalDecoder(tok)
    text = "".join(decoder.push(t) for t in ids[:-1])  # stop one byte short of the snowman
    assert not text.endswith("\ufffd")
    tail = decoder.flush()
    assert tail and tail.endswith("\ufffd")
    assert text + tail == tok.decode(ids[:-1])


def test_finished_text_equals_decoded_tokens(pretrained):
    engine = LLMEngine(pretrained.model, pretrained.tokenizer, EngineConfig(num_blocks=64), pretrained.eos_token_ids)
    for i in range(16):
        engine.add_request(str(i), "def add(a, b):", SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                                    ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for c in finals.values():
        assert c.text == pretrained.tokenizer.decode(c.token_ids)
    assert any(c.text.endswith("\ufffd") for c in finals.values()), "no case of a held-back tail was exercised"
