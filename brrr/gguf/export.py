"""`brrr export gguf`: an HF model directory (config.json, safetensors, tokenizer.json) -> one GGUF file.

Tensors are read one at a time from the memory-mapped safetensors, quantized (writer.py) and handed to the writer,
so a model is never held twice; derived tensors (a tied lm_head, rotary inv_freq) are not written."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.gguf.writer import write_gguf
from brrr.gguf.tokenizer import to_gguf
from brrr.loader import weight_files
from brrr.progress import progress


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise BrrrError(f"{path} is not valid JSON: {e}") from None


def tokenizer_metadata(model_dir: Path, vocab_size: int = 0) -> dict:
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        raise BrrrError(f"tokenizer.json not found in {model_dir}: a GGUF file carries its tokenizer")
    config = _json(model_dir / "tokenizer_config.json")
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        config["chat_template"] = jinja.read_text()
    return to_gguf(file.read_text(), config, vocab_size)


def export_gguf(model_dir: str | Path, out: str | Path, file_type: str = "f16", show_progress: bool = False) -> dict:
    """Write `out` from the HF directory `model_dir`; returns how many tensors took each GGUF type."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BrrrError(f"--model must be an HF model directory; {model_dir} is not a directory")
    raw = _json(model_dir / "config.json")
    cfg = ModelConfig.from_hf(raw, source=str(model_dir / "config.json"))  # refuses what brrr cannot describe
    if raw.get("quantization_config"):
        raise BrrrError(f"{model_dir} is a quantized checkpoint (config.json has quantization_config); export the "
                        "float model it came from, and pick the GGUF quantization with --type")
    tokenizer = tokenizer_metadata(model_dir, cfg.vocab_size)
    files = weight_files(model_dir)
    names = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names += [(file, k) for k in f.keys() if not k.endswith("rotary_emb.inv_freq")
                      and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]

    def tensors():
        for file, key in names:
            with safe_open(str(file), framework="pt") as f:
                yield key, f.get_tensor(key)

    with progress(f"export gguf {file_type}", len(names), show_progress) as advance:
        return write_gguf(out, {**raw, "architectures": [cfg.architecture]}, tensors(), tokenizer, file_type,
                          name=model_dir.name, progress=advance)
