"""A GGUF file's tokenizer (`tokenizer.ggml.*`) <-> a `tokenizers` tokenizer, ids equal to transformers' GGUF one.

A GGUF carries no tokenizer.json: it stores the vocabulary in id order (`tokens`), a type per token (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), BPE `merges` ("a b"), per-token `scores`, and which
tokenizer family reads them (`model`): "gpt2" is byte-level BPE (GPT-2's byte-to-unicode alphabet), "llama" is a
SentencePiece-style BPE with "▁" for spaces and <0xNN> byte fallback. `pre` names how text is split before BPE
(llama.cpp's names; the split regex each stands for is in PRE_SPLITS). `from_gguf` rebuilds the tokenizer the way
transformers does, so token ids match it (tests/gguf/test_tokenizer.py); `to_gguf` writes the keys back (export)."""
from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from brrr.errors import BrrrError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer names -> the split regex (names without an entry keep GPT-2's own ByteLevel split)
PRE_SPLITS = {"llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
              "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (byte-level BPE vocabularies are written in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two vocabulary tokens, best
    score first (ties: shorter left piece, then shorter right; within one token, by the pieces' ids), the order
    transformers derives them in."""
    vocab = {t: i for i, t in enumerate(tokens)}
    by_score = dict(zip(tokens, scores))
    found = []
    for token, score in by_score.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found = sorted(found, key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _strings(meta: dict, key: str, source: str, n: int | None = None) -> list:
    value = meta.get(key)
    if not isinstance(value, list) or (n is not None and len(value) != n):
        want = "a list" if n is None else f"a list of {n}"
        raise BrrrError(f"{source}: cannot rebuild the tokenizer: metadata key {key!r} must be {want}, got "
                        f"{type(value).__name__}{'' if not isinstance(value, list) else f' of {len(value)}'}")
    return value


def from_gguf(meta: dict, source: str = "GGUF") -> tuple[Tokenizer, dict]:
    """(the tokenizer, a tokenizer_config-style dict: special token strings and chat_template) from the file's
    metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise BrrrError(f"{source}: cannot rebuild the tokenizer: metadata key 'tokenizer.ggml.model' is {kind!r}; "
                        "brrr reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style BPE)")
    tokens = _strings(meta, "tokenizer.ggml.tokens", source)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise BrrrError(f"{source}: cannot rebuild the tokenizer: metadata key 'tokenizer.ggml.tokens' must be a "
                        "non-empty list of strings")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise BrrrError(f"{source}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries for "
                        f"{len(tokens)} tokens")
    if "tokenizer.ggml.merges" in meta:
        raw = _strings(meta, "tokenizer.ggml.merges", source)
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else () for m in raw]
        if any(len(m) != 2 for m in merges):
            raise BrrrError(f"{source}: metadata key 'tokenizer.ggml.merges' holds an entry that is not two tokens "
                            "joined by a space")
    elif kind == "llama":
        merges = merges_from_scores(tokens, _strings(meta, "tokenizer.ggml.scores", source, len(tokens)))
    else:
        raise BrrrError(f"{source}: cannot rebuild the tokenizer: metadata key 'tokenizer.ggml.merges' is missing "
                        "(a byte-level BPE needs its merges)")
    try:
        if kind == "gpt2":
            spelling = bytes_to_unicode()
            alphabet = set(spelling.values())
            vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                     for i, t in enumerate(tokens)}
            tok = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                       fuse_unk=False, dropout=None))
            split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
            tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                                 pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)]))
            tok.decoder = decoders.ByteLevel()
            controls = [t for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
        else:
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
            controls = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    except Exception as e:  # tokenizers rejects merges naming tokens not in the vocabulary
        raise BrrrError(f"{source}: cannot rebuild the tokenizer from 'tokenizer.ggml.tokens'/'merges': {e}") from None
    config = {}
    for name, key in SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tokens):
                raise BrrrError(f"{source}: metadata key 'tokenizer.ggml.{key}' is {i!r}, not a token id "
                                f"(0 to {len(tokens) - 1})")
            config[name] = tokens[i]
    specials = list(dict.fromkeys(controls + [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                              if k in config]))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    bos, eos = config.get("bos_token"), config.get("eos_token")
    single = ([f"{bos}:0"] if add_bos and bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos and eos else [])
    pair = single + [s.replace("$A", "$B").replace(":0", ":1") for s in single]
    used = {t for t in (bos if add_bos else None, eos if add_eos else None) if t}
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                       special_tokens=[(t, vocab.get(t, tok.token_to_id(t)))
                                                                       for t in used])
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    config["add_bos_token"], config["add_eos_token"] = bool(add_bos), bool(add_eos)
    return tok, config


def _split_regex(pre: dict | None) -> str | None:
    """The regex of a Sequence[Split, ByteLevel(use_regex=False)] pre-tokenizer, else None."""
    if not pre or pre.get("type") != "Sequence":
        return None
    for p in pre.get("pretokenizers", []):
        if p.get("type") == "Split":
            pattern = p.get("pattern", {})
            return pattern.get("Regex") or pattern.get("String")
    return None


def to_gguf(tokenizer_json: str, config: dict, vocab_size: int = 0) -> dict:
    """The `tokenizer.*` metadata for a tokenizer.json text and its tokenizer_config dict (export). A model with
    more embedding rows than tokens gets "[PAD<i>]" unused tokens to fill them, as llama.cpp writes."""
    tj = json.loads(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise BrrrError(f"brrr exports BPE tokenizers to GGUF; this tokenizer.json's model is {model.get('type')!r}")
    vocab = dict(model["vocab"])
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = max(max(vocab.values()) + 1, vocab_size)
    tokens, types = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(t)
        types[i] = (CONTROL if a["special"] else USER_DEFINED) if a else BYTE if (
            model.get("byte_fallback") and len(t) == 6 and t.startswith("<0x") and t.endswith(">")) else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = tj.get("pre_tokenizer") or {}
    if model.get("byte_fallback"):
        kind, pre_name = "llama", "default"
    else:
        kind = "gpt2"
        regex = _split_regex(pre)
        names = {v: k for k, v in reversed(list(PRE_SPLITS.items()))}
        if regex is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
            pre_name = "gpt-2"
        elif regex in names:
            pre_name = names[regex]
        else:
            raise BrrrError("the tokenizer's pre-tokenizer has no llama.cpp name brrr knows (GPT-2's ByteLevel, "
                            f"{', '.join(sorted(set(PRE_SPLITS)))}); it cannot be exported faithfully")
    out = {"tokenizer.ggml.model": kind, "tokenizer.ggml.pre": pre_name, "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    if kind == "llama":
        out["tokenizer.ggml.scores"] = [-float(i) for i in range(n)]
    for name, key in SPECIAL_IDS.items():
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value in vocab:
            out[f"tokenizer.ggml.{key}"] = vocab[value]
    post = json.dumps(tj.get("post_processor") or {})
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    out["tokenizer.ggml.add_bos_token"] = bool(config.get("add_bos_token", bos is not None and json.dumps(bos) in post))
    out["tokenizer.ggml.add_eos_token"] = bool(config.get("add_eos_token", False))
    template = config.get("chat_template")
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out
