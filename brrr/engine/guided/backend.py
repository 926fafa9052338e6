"""The grammar backend: llguidance (docs/structured-outputs.md says why). A constraint (StructuredOutputsParams) becomes
an llguidance grammar, compiled once per (kind, spec) per tokenizer into a matcher in its start state; every guided
sequence gets a copy of that matcher, which it advances token by token and asks for the next token mask.

Compiling (building the parser tables against the vocabulary) is the expensive part; copying a compiled matcher is
not, so the cache keeps compiled matchers, not grammar text."""
from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict

import llguidance

from brrr.errors import BrrrError
from brrr.sampling_params import StructuredOutputsParams

log = logging.getLogger("brrr.engine")
CACHE_SIZE = 512  # compiled grammars kept per tokenizer; a server sees a few schemas many times, not many once
# Compact JSON with json.dumps' separators: what models saw most in training. Flexible whitespace would let a model
# put any run of blanks between tokens, which a weak or random model does until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (text; not yet checked beyond its JSON)."""
    kind = spec.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(_schema(spec.json), defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec.choice)
        # Lark, llguidance's own dialect; GBNF/EBNF (`root ::= ...`, llama.cpp's and xgrammar's) is converted
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise BrrrError(f"structured_outputs.{kind}: {e}") from None


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): equal constraints share one compiled grammar."""
    kind = spec.kind
    if kind == "json":
        return kind, json.dumps(_schema(spec.json), sort_keys=True)
    if kind == "choice":
        return kind, json.dumps(spec.choice)
    return kind, {"json_object": "", "regex": spec.regex, "grammar": spec.grammar}[kind]


def _schema(schema: dict | str) -> dict:
    return json.loads(schema) if isinstance(schema, str) else schema


class GrammarCompiler:
    """Compiled grammars for one tokenizer and vocabulary: `compile` checks a constraint (BrrrError naming its field),
    `matcher` gives a sequence its own matcher. Safe to share between threads (the server checks requests while the
    engine thread compiles for its sequences)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher in its start state (cached; do not advance it: copy it)."""
        key = spec_key(spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return compiled
        # outside the lock: a large grammar takes a while to compile (llguidance releases the GIL meanwhile)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise BrrrError(f"structured_outputs.{spec.kind}: {_first_lines(matcher.get_error())}")
        for warning in matcher.get_grammar_warnings():
            log.debug("structured_outputs.%s: %s", spec.kind, warning)
        with self._lock:
            self.misses += 1
            self._compiled[key] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> "GuidedMatcher":
        return GuidedMatcher(self.compile(spec).deep_copy())


def _first_lines(message: str, limit: int = 4) -> str:
    """llguidance's errors end with a caret diagram of the grammar line: keep the message, drop the picture's tail."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit])


class GuidedMatcher:
    """One sequence's place in its grammar. `accept` advances it by a sampled token; `finished` says the grammar is
    complete and cannot continue (only EOS would be allowed next)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """False when the grammar does not allow `token` (the matcher is then dead: `error` says why)."""
        return self.matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here (the matcher does not move)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def advanced(self, tokens: list[int]) -> "GuidedMatcher":
        """A copy moved past `tokens` (allowed ones): where a speculative run's later positions stand."""
        copy = GuidedMatcher(self.matcher.deep_copy())
        copy.matcher.consume_tokens(tokens)
        return copy

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


_COMPILERS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids=()) -> GrammarCompiler:
    """The GrammarCompiler for a brrr Tokenizer, a model vocabulary size (masks cover the model's logits, which may
    be padded past the tokenizer's ids) and the EOS ids the grammar lets through when it accepts. One per such
    combination for the tokenizer's lifetime: building one reads the whole vocabulary."""
    key = (vocab_size, tuple(eos_token_ids))
    with _COMPILERS_LOCK:
        per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
        compiler = per_tokenizer.get(key)
        if compiler is None:
            compiler = per_tokenizer[key] = GrammarCompiler(tokenizer.to_json(), vocab_size, tuple(eos_token_ids))
    return compiler


def compile_cache_info() -> dict:
    """Hits, misses and compiled grammars over every compiler (tests and debugging; not an API)."""
    with _COMPILERS_LOCK:
        compilers = [c for per in _COMPILERS.values() for c in per.values()]
    return {"hits": sum(c.hits for c in compilers), "misses": sum(c.misses for c in compilers),
            "size": sum(len(c._compiled) for c in compilers)}
