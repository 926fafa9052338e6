"""Resolve what the user named into a local model directory: the shipped default, a local path, or an HF hub id
(through huggingface_hub's cache, downloading when the network allows), or a GGUF file."""
from __future__ import annotations

from pathlib import Path

from brrr.default_model import default_model_dir
from brrr.errors import BrrrError
from brrr.gguf.reader import is_gguf

HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def resolve_model(name: str | Path | None) -> Path:
    if name is None or str(name) == "default":
        return default_model_dir()
    path = Path(name).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise BrrrError(f"--model must be a directory holding config.json and *.safetensors, or a .gguf file; "
                        f"{path} is neither")
    text = str(name)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return _from_hub(text)
    raise BrrrError(f"model directory not found: {path}")


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise BrrrError(f"{repo_id!r} is not a local directory, and huggingface_hub is not installed to fetch it "
                        "(pip install 'brrr[hub]')") from None
    try:  # the local cache first: works offline and costs no request
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:
        raise BrrrError(f"could not get {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                        "It is not in the local cache and the hub is unreachable or refused; download it where "
                        "the network allows and pass --model DIR") from None
