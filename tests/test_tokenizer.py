"""Tokenizer round-trip and chat-template rendering against transformers."""
import pytest
import transformers

from brrr import BrrrError, Tokenizer
from brrr.tokenizer import IncrementalDecoder
from brrr.train.tokenizer import build_tokenizer

TEXT = ["def add(a, b):\n    return a + b\n", "Hello, world! Ünïcödé text — with dashes.", "class Foo:\n    pass\n"] * 20

# A Llama-3-style template with a system-message check that raises, and a ChatML one using tojson for tools.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('system message must be first') }}{% endif %}"
    "{{ '<|start|>' + message['role'] + '<|sep|>\n\n' + message['content'] | trim + '<|eot|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant<|sep|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{% if message.content is string %}{{ message.content }}{% else %}{{ message.content | tojson }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    "{{ eos_token if not add_generation_prompt else '' }}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Write a haiku about caches"}],
    [{"role": "user", "content": "Ünïcödé & <html> \"quotes\""}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module", params=[LLAMA3_TEMPLATE, CHATML_TEMPLATE], ids=["llama3", "chatml"])
def tokenizer_dir(request, tmp_path_factory):
    tok = build_tokenizer(TEXT, vocab=400)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                              pad_token="<|pad|>")
    hf.chat_template = request.param
    path = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(path)
    return path


def test_round_trip_and_ids_match_transformers(tokenizer_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = Tokenizer.from_dir(tokenizer_dir)
    for text in ["def add(a, b):\n    return a + b", "Ünïcödé — ok", "  leading spaces\tand tabs\n\n"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert tok.decode(ids) == text
        assert ids[0] == tok.bos_token_id


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tokenizer_dir, conversation, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = Tokenizer.from_dir(tokenizer_dir)
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          return_dict=False)
    assert tok.encode_chat(messages, add_generation_prompt) == list(expected_ids)


def test_template_raise_exception_is_a_clear_error():
    tok = Tokenizer(build_tokenizer(TEXT, vocab=300), {"bos_token": "<|bos|>"}, LLAMA3_TEMPLATE)
    with pytest.raises(BrrrError, match="system message must be first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_incremental_decoder_streams_the_full_text(tokenizer_dir):
    tok = Tokenizer.from_dir(tokenizer_dir)
    text = "def add(a, b):\n    return a + b  # Ünïcödé — ok"
    decoder = IncrementalDecoder(tok)
    assert "".join(decoder.push(t) for t in tok.encode(text)) == text


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(BrrrError, match="tokenizer.json not found"):
        Tokenizer.from_dir(tmp_path)
