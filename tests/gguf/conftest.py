"""Tiny random HF checkpoints (hidden 64, 2 layers) written as GGUF files with brrr's exporter (gguf.GGUFWriter)."""
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from brrr.gguf.export import export_gguf
from tests import hf_models

# family -> the hf_models family and overrides. transformers' GGUF reader takes Qwen3's head_dim from its config
# default (128), not from the file, so the Qwen3 checkpoint uses 128 for both to read alike.
FAMILIES = {"llama": ("head-dim-32", {}), "mistral": ("mistral-sliding", {}), "qwen2": ("qwen2-bias", {}),
            "qwen3": ("qwen3-qknorm", {"head_dim": 128}), "tied": ("tied", {})}
TEXT = "Hello, world! 1234567 déjà vu ünïcödé 🚀 <|im_start|>user\n def add(a, b): return a + b<|im_end|>"


def save_spm_tokenizer(path):
    """A SentencePiece-style BPE (Metaspace "▁", <0xNN> byte fallback, <s> prepended), as Llama 2 ships one."""
    words = ["Hello, world! The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"] * 20
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer_tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    trained = trainer_tok.get_vocab()
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for t, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in
              __import__("json").loads(trainer_tok.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    hf.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    hf.save_pretrained(path)
    return len(vocab)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """family -> (HF directory, the transformers model)."""
    made = {}

    def get(family):
        if family not in made:
            name, over = FAMILIES[family]
            path = tmp_path_factory.mktemp(f"hf-{family}")
            model = hf_models.build(name, vocab_size=320, **over)
            hf_models.save(model, path)
            hf_models.save_tokenizer(path)
            made[family] = path, model
        return made[family]
    return get


@pytest.fixture(scope="session")
def gguf_file(hf_dir, tmp_path_factory):
    """(family, type) -> a GGUF file exported from that family's checkpoint."""
    made = {}

    def get(family, file_type):
        if (family, file_type) not in made:
            path, _ = hf_dir(family)
            out = tmp_path_factory.mktemp("gguf") / f"{family}-{file_type}.gguf"
            export_gguf(path, out, file_type)
            made[family, file_type] = out
        return made[family, file_type]
    return get
