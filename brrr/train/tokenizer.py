"""Byte-level BPE tokenizers trained with the `tokenizers` library, and the HF files that describe them."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab: int, show_progress: bool = False):
    """Train a byte-level BPE (GPT-2 pre-tokenization, all 256 bytes in the base alphabet, so any text encodes
    and decodes back exactly) with the SPECIALS first; encoding prepends <|bos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return tok


def special_ids(tok) -> dict[str, int]:
    return {"bos": tok.token_to_id("<|bos|>"), "eos": tok.token_to_id("<|eos|>"), "pad": tok.token_to_id("<|pad|>"),
            "im_end": tok.token_to_id("<|im_end|>")}


def tokenizer_config(max_length: int | None) -> dict:
    """tokenizer_config.json for a tokenizer from build_tokenizer (what transformers' AutoTokenizer reads);
    max_length is the model's context (None: not tied to a model yet)."""
    cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    if max_length is not None:
        cfg["model_max_length"] = max_length
    return cfg


def write_tokenizer_files(tok, out: Path, max_length: int | None):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(max_length), indent=2) + "\n")
