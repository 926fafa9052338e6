"""Tiny random HF checkpoints (hidden 64, 2 layers) written as GGUF files with brrr's exporter (gguf.GGUFWriter);
wider ones (hidden 256) whose projections take a chosen block type, for the group-wise repack."""
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFValueType, GGUFWriter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from brrr.gguf.export import export_gguf
from brrr.gguf.writer import quantize, tensor_type
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


# hidden 256, intermediate 512, head_dim 64 (so o_proj's input is 256 too): every projection row is whole K-quant
# super-blocks. spec -> the block type of a blk.* weight (name, torch shape): one type, or Q4_K_M's mix from the
# exporter's recipe (Q6_K attn_v and ffn_down in layer 1 of 2, Q4_K elsewhere)
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
SPECS = {"q8_0": T.Q8_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q5_0": T.Q5_0,
         "q4_k_m": lambda name, shape: tensor_type("q4_k_m", name, shape, 2)}


def quantize_q5_k(w: torch.Tensor) -> np.ndarray:
    """Q5_K blocks [rows, cols / 256 * 176] near w (brrr has no Q5_K quantizer): brrr's Q4_K blocks with d halved
    and each code q doubled plus a random low bit (2q + b in 0..31), so every bit of the 5-bit codes varies."""
    b = torch.from_numpy(quantize(w, T.Q4_K)).reshape(-1, 144)
    n = b.shape[0]
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(n, 8, 32)  # sub-block 2g: bytes 32g.. low nibbles, 2g+1: high
    q = 2 * q + torch.randint(0, 2, q.shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    low = (q & 15).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = ((q >> 4) << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)).sum(1).to(torch.uint8)  # bit j: sub-block j
    d = (b[:, :2].contiguous().view(torch.float16) / 2).view(torch.uint8)
    return torch.cat([d, b[:, 2:16], qh, qs], dim=1).reshape(w.shape[0], -1).numpy()


def retyped(src, out, type_of):
    """A copy of the F32 GGUF file src with each 2-D blk.* weight quantized to type_of(name, torch shape)."""
    r = GGUFReader(src)
    w = GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            array = f.types[0] == GGUFValueType.ARRAY
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if array else None)
    for t in r.tensors:
        data = np.array(t.data)
        qtype = type_of(t.name, data.shape) if t.name.startswith("blk.") and data.ndim == 2 else T.F32
        if qtype == T.F32:
            w.add_tensor(t.name, data)
        else:
            x = torch.from_numpy(data)
            w.add_tensor(t.name, quantize_q5_k(x) if qtype == T.Q5_K else quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def wide_gguf(tmp_path_factory):
    """(family, spec) -> a GGUF file of that family at WIDE sizes, its projections typed by SPECS[spec]."""
    made, sources = {}, {}

    def get(family, spec):
        if family not in sources:
            name, over = FAMILIES[family]
            path = tmp_path_factory.mktemp(f"hf-wide-{family}")
            hf_models.save(hf_models.build(name, vocab_size=320, **{**over, **WIDE}), path)
            hf_models.save_tokenizer(path)
            sources[family] = path / "f32.gguf"
            export_gguf(path, sources[family], "f32")
        if (family, spec) not in made:
            out = sources[family].parent / f"{spec}.gguf"
            kind = SPECS[spec]
            retyped(sources[family], out, kind if callable(kind) else lambda name, shape: kind)
            made[family, spec] = out
        return made[family, spec]
    return get
