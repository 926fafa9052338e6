"""The tokenizer brrr rebuilds from tokenizer.ggml.* gives transformers' GGUF tokenizer's ids."""
import pytest
import transformers
from gguf import GGUFReader

from brrr.gguf.export import export_gguf, tokenizer_metadata
from brrr.gguf.tokenizer import from_gguf
from brrr.gguf.writer import write_gguf
from brrr.tokenizer import Tokenizer
from tests import hf_models
from tests.gguf.conftest import TEXT, save_spm_tokenizer

TEXTS = [TEXT, "  leading spaces and\ttabs\n\nnewlines", "<s>special</s> in text", "数字 12 345 6789"]


def _hf_tok(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_byte_level_bpe_ids_equal_transformers(gguf_file):
    path = gguf_file("qwen2", "f16")
    mine, theirs = Tokenizer.from_dir(path), _hf_tok(path)
    for text in TEXTS:
        assert mine.encode(text) == theirs(text)["input_ids"], text
        assert mine.decode(mine.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    assert mine.special_tokens["eos_token"] == "<|eos|>" and "im_start" in mine.chat_template


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    vocab = save_spm_tokenizer(d)
    model = hf_models.build("tied", vocab_size=vocab)
    hf_models.save(model, d)
    export_gguf(d, d / "spm.gguf", "f32")
    return d


def test_sentencepiece_bpe_ids_equal_transformers_and_the_original(spm_file):
    path = spm_file / "spm.gguf"
    assert GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "llama"
    mine, theirs = Tokenizer.from_dir(path), _hf_tok(path)
    original = transformers.AutoTokenizer.from_pretrained(spm_file)
    for text in TEXTS:
        assert mine.encode(text) == theirs(text)["input_ids"] == original(text)["input_ids"], text
        assert mine.decode(mine.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    assert mine.encode_chat([{"role": "user", "content": "hi"}]) == original.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_sentencepiece_merges_derived_from_scores_equal_transformers(spm_file, tmp_path):
    """llama.cpp's SentencePiece files carry scores and no merges: both sides derive the merges from them."""
    meta = tokenizer_metadata(spm_file)
    del meta["tokenizer.ggml.merges"]
    meta["tokenizer.ggml.scores"] = [float(-i) for i in range(len(meta["tokenizer.ggml.tokens"]))]
    model = transformers.AutoModelForCausalLM.from_pretrained(spm_file)
    out = tmp_path / "scores.gguf"
    config = model.config.to_dict()
    write_gguf(out, config, [(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"], meta, "f32")
    mine, theirs = Tokenizer.from_dir(out), _hf_tok(out)
    for text in TEXTS:
        assert mine.encode(text) == theirs(text)["input_ids"], text


def test_a_tokenizer_that_cannot_be_rebuilt_names_the_key():
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="tokenizer.ggml.eos_token_id"):
        from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": [],
                   "tokenizer.ggml.eos_token_id": 7})
    with pytest.raises(ValueError, match="Token `c` out of vocabulary"):
        from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                   "tokenizer.ggml.merges": ["a c"]})
    with pytest.raises(ValueError, match="'tokenizer.ggml.scores' must be a list of 2"):
        from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="tokenizer.ggml.bos_token_id"):
        from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": [],
                   "tokenizer.ggml.bos_token_id": True})
    with pytest.raises(ValueError, match="tokenizer.ggml.token_type"):
        from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0],
                   "tokenizer.ggml.token_type": [1, 1]})


def test_a_split_regex_pre_tokenizer_and_user_defined_tokens_round_trip(tmp_path):
    """A Qwen2-style tokenizer (its own split regex before byte-level BPE, a non-special added token): exported as
    pre "qwen2" with <think> USER_DEFINED, read back with the same ids as transformers and the original."""
    from tokenizers import AddedToken, Regex, pre_tokenizers

    from brrr.gguf.tokenizer import QWEN2_SPLIT, USER_DEFINED
    from brrr.train.tokenizer import build_tokenizer

    tok = build_tokenizer(["def add(a, b):\n    return a + b\n", "Hello, world! 1234 <think> ok"] * 20, 300)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    hf.save_pretrained(tmp_path)
    hf_models.save(hf_models.build("qwen2-bias", vocab_size=320), tmp_path)
    export_gguf(tmp_path, tmp_path / "q.gguf", "f32")
    fields = GGUFReader(tmp_path / "q.gguf").fields
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert types[tokens.index("<think>")] == USER_DEFINED
    mine, theirs = Tokenizer.from_dir(tmp_path / "q.gguf"), _hf_tok(tmp_path / "q.gguf")
    original = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS + ["a<think>b 12345678"]:
        assert mine.encode(text) == theirs(text)["input_ids"] == original(text)["input_ids"], text


@pytest.mark.parametrize("dropped", ["tokenizer.ggml.add_bos_token", "tokenizer.ggml.pre"])
def test_files_without_optional_keys_read_like_transformers(hf_dir, tmp_path, dropped):
    """Older files lack add_bos_token (the default then depends on the tokenizer family) or the pre name."""
    path, model = hf_dir("llama")
    meta = tokenizer_metadata(path, model.config.vocab_size)
    del meta[dropped]
    out = tmp_path / "old.gguf"
    write_gguf(out, model.config.to_dict(), model.state_dict().items(), meta, "f32")
    mine, theirs = Tokenizer.from_dir(out), _hf_tok(out)
    for text in TEXTS:
        assert mine.encode(text) == theirs(text)["input_ids"], text
