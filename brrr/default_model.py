"""The shipped default model, until the trained one lands: a tiny Llama-architecture checkpoint with RANDOM
(untrained) weights and a byte-level BPE tokenizer trained on brrr's own source. Built deterministically on first
use and cached, so `brrr generate` works on a fresh machine in seconds; its output is noise by design."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from brrr import __version__

RECIPE = "untrained-v1"  # bump when the recipe below changes, so caches rebuild
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, vocab=1024)


def cache_root() -> Path:
    if os.environ.get("BRRR_CACHE"):
        return Path(os.environ["BRRR_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "brrr"


def default_model_dir() -> Path:
    """Path of the default model, building it first if it is not cached yet."""
    digest = hashlib.sha256("\0".join(_corpus()).encode()).hexdigest()[:10]  # the tokenizer depends on the corpus
    path = cache_root() / f"default-model-{RECIPE}-{digest}"
    if not (path / "model.safetensors").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".build-"))
        try:
            build_default_model(tmp)
            try:
                tmp.rename(path)
            except OSError:  # another process finished first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _corpus() -> list[str]:
    pkg = Path(__file__).parent
    return [p.read_text(encoding="utf-8") for p in sorted(pkg.rglob("*.py"))]


def build_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    return tok


def build_default_model(out: Path):
    from brrr.config import ModelConfig
    from brrr.loader import save_model
    from brrr.models import model_class

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(_corpus(), SHAPE["vocab"])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": SHAPE["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2) + "\n")
    eos = [ids["<|eos|>"], ids["<|im_end|>"]]
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], **{k: v for k, v in SHAPE.items() if k != "vocab"},
        "vocab_size": tok.get_vocab_size(), "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": ids["<|bos|>"], "eos_token_id": eos, "torch_dtype": "float32",
    })
    torch.manual_seed(0)
    model = model_class(cfg)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)  # the init transformers uses for Llama
    save_model(model, out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|bos|>"], "eos_token_id": eos, "do_sample": True, "temperature": 0.8}, indent=2) + "\n")
    (out / "README.md").write_text(
        f"brrr's default model ({RECIPE}, built by brrr {__version__}): random, UNTRAINED weights in the "
        "Llama architecture and a BPE tokenizer trained on brrr's source. It exists so brrr runs anywhere; "
        "its text is noise.\n")
