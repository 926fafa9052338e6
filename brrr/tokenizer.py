"""Tokenizer from an HF model directory: tokenizer.json through the `tokenizers` library, special tokens and the
chat template from tokenizer_config.json (or chat_template.jinja), rendered with jinja2 as transformers does."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from brrr.errors import BrrrError
from brrr.gguf.reader import is_gguf, open_gguf
from brrr.gguf.tokenizer import from_gguf

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value):
    """tokenizer_config.json stores a special token as a string or as a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        self._tok = tokenizer
        config = config or {}
        self.special_tokens = {k: _token_str(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        self.chat_template: str | None = template

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if is_gguf(path):  # rebuilt from tokenizer.ggml.* (brrr/gguf/tokenizer.py)
            tok, config = from_gguf(open_gguf(path).metadata, str(path))
            return cls(tok, config)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise BrrrError(f"tokenizer.json not found in {path} (brrr needs a fast-tokenizer file)")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:
            raise BrrrError(f"cannot read {file}: {e}") from None
        config = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise BrrrError(f"{cfg_file} is not valid JSON: {e}") from None
        jinja_file = path / "chat_template.jinja"
        template = jinja_file.read_text() if jinja_file.is_file() else None
        return cls(tok, config, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token's string and id, added tokens included: two tokenizers read ids alike when these are equal."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text (what the grammar backend builds its token tables from)."""
        return self._tok.to_str()

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("eos_token"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise BrrrError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise BrrrError(f"messages[{i}] must be an object with a 'role' (and usually 'content')")
        variables = {**self.special_tokens, **kwargs}
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
            raise BrrrError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """tools: OpenAI tool objects, passed to the template as transformers passes them (it renders them)."""
        # The template already writes bos/eos where the model wants them, so no special tokens are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools=tools),
                           add_special_tokens=False)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's built-in tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise BrrrError(f"chat template does not parse: {e}") from None


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas. Decodes only a short window (the last emitted tokens plus the
    new ones) and diffs it against the window without the new ones, so word-joining spaces come out right, cost
    stays O(1) per token, and incomplete UTF-8 (decoded as U+FFFD) is held back until it completes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        after = decode(self.ids[self.prefix_offset:], self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """At the end of a sequence: whatever push() still holds back (an incomplete UTF-8 tail, which decodes to
        U+FFFD), so the final text equals decoding all the ids and no generated token is silently dropped."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        after = decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
