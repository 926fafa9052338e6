"""`brrr data build`: Python source on this machine -> a BPE tokenizer and flat token files per split.

Layout of a data directory:
  tokenizer.json, tokenizer_config.json   the tokenizer (HF files), trained on the train split
  train.bin, val.bin                      every document as <|bos|> tokens <|eos|>, concatenated (uint16, or
                                          uint32 when the vocabulary outgrows 65,536), read with np.memmap
  train.idx, val.idx                      uint64 offsets where each document starts, plus the end
  manifest.json                           files, token counts, each source's token range, the tokenizer's hash
                                          (written last: a directory without it is not a finished build)

A file's split is decided by a hash of its path relative to its source root (`json/decoder.py`), so the same
file lands in the same split on every machine. Files whose content was already seen are skipped, so no text
is both trained on and validated on.
"""
from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from brrr import __version__
from brrr.errors import BrrrError
from brrr.token_data import FORMAT
from brrr.train.tokenizer import build_tokenizer, special_ids, write_tokenizer_files

SPLITS = ("train", "val")
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # the stdlib tree holds site-packages: not stdlib
ENCODE_CHUNK_BYTES = 8 << 20  # text handed to the tokenizer's parallel encode_batch at a time


@dataclass
class SourceFile:
    source: str
    relpath: str  # POSIX path relative to the source root: the split key
    text: str
    split: str
    tokens: int = 0


@dataclass
class BuildStats:
    scanned: int = 0
    skipped: dict = field(default_factory=lambda: {"duplicate": 0, "not_utf8": 0, "too_large": 0, "empty": 0})


def source_roots(spec: str) -> tuple[str, list[Path]]:
    """(name, root directories) for 'stdlib', 'site-packages' or a directory path."""
    if spec == "stdlib":
        return "stdlib", [Path(sysconfig.get_paths()["stdlib"])]
    if spec == "site-packages":
        dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
        roots = []
        for d in dirs:
            p = Path(d).resolve()
            if p.is_dir() and p not in roots:
                roots.append(p)
        return "site-packages", roots
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise BrrrError(f"--source {spec!r} is not 'stdlib', 'site-packages' or a directory")
    return spec, [path.resolve()]


def split_of(relpath: str, val_fraction: float) -> str:
    """'val' for a stable val_fraction of paths: the first 8 bytes of sha256(relpath) as a fraction of 2^64."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return "val" if h < val_fraction * 2**64 else "train"


def _walk_py(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return found


def collect(specs: list[str], val_fraction: float, max_file_bytes: int,
            progress=None) -> tuple[list[SourceFile], dict, BuildStats]:
    """Read every .py file under the sources, in a fixed order; skip duplicates, non-UTF-8, oversized, empty."""
    files, roots_by_source, seen, stats = [], {}, set(), BuildStats()
    for spec in specs:
        name, roots = source_roots(spec)
        roots_by_source.setdefault(name, []).extend(str(r) for r in roots)
        paths = [(root, p) for root in roots for p in _walk_py(root)]
        task = progress.add_task(f"read {name}", total=len(paths)) if progress else None
        for root, p in paths:
            stats.scanned += 1
            if progress:
                progress.advance(task)
            try:
                if p.stat().st_size > max_file_bytes:
                    stats.skipped["too_large"] += 1
                    continue
                raw = p.read_bytes()
            except OSError:
                stats.skipped["not_utf8"] += 1  # unreadable (a dangling link): counted with undecodable files
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skipped["not_utf8"] += 1
                continue
            if not text.strip():
                stats.skipped["empty"] += 1
                continue
            digest = hashlib.sha256(raw).digest()
            if digest in seen:
                stats.skipped["duplicate"] += 1
                continue
            seen.add(digest)
            rel = p.relative_to(root).as_posix()
            files.append(SourceFile(name, rel, text, split_of(rel, val_fraction)))
    if not files:
        raise BrrrError(f"no usable .py files under --source {' '.join(specs)} "
                        f"({stats.scanned} scanned; skipped: {stats.skipped})")
    return files, roots_by_source, stats


def tokenizer_sample(files: list[SourceFile], max_bytes: int) -> list[str]:
    """Train-split texts for tokenizer training: all of them, or a fixed pseudo-random subset of ~max_bytes."""
    train = [f for f in files if f.split == "train"] or files
    order = sorted(train, key=lambda f: hashlib.sha256(f"{f.source}/{f.relpath}".encode()).digest())
    out, total = [], 0
    for f in order:
        if total >= max_bytes:
            break
        out.append(f.text)
        total += len(f.text)
    return out


def _chunks(files: list[SourceFile]):
    chunk, size = [], 0
    for f in files:
        chunk.append(f)
        size += len(f.text)
        if size >= ENCODE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def write_split(tok, files: list[SourceFile], bin_path: Path, idx_path: Path, dtype, progress=None) -> int:
    """Encode files (in parallel, through encode_batch) as <|bos|> ids <|eos|> and append them to bin_path."""
    ids = special_ids(tok)
    offsets = [0]
    task = progress.add_task(f"tokenize {bin_path.stem}", total=sum(len(f.text) for f in files)) if progress else None
    with open(bin_path, "wb") as out:
        for chunk in _chunks(files):
            encodings = tok.encode_batch([f.text for f in chunk], add_special_tokens=False)
            parts = []
            for f, enc in zip(chunk, encodings):
                doc = np.empty(len(enc.ids) + 2, dtype=dtype)
                doc[0], doc[-1] = ids["bos"], ids["eos"]
                doc[1:-1] = enc.ids
                f.tokens = len(doc)
                offsets.append(offsets[-1] + len(doc))
                parts.append(doc)
            np.concatenate(parts).tofile(out)
            if progress:
                progress.advance(task, sum(len(f.text) for f in chunk))
    np.asarray(offsets, dtype=np.uint64).tofile(idx_path)
    return offsets[-1]


def build(out: str | Path, sources: list[str], vocab: int = 8192, val_fraction: float = 0.05,
          max_file_kb: int = 1024, tokenizer_sample_mb: float = 256, show_progress: bool = True) -> dict:
    """Build a data directory (see the module docstring); returns the manifest."""
    from tokenizers import Tokenizer

    if vocab < 256 + 5:
        raise BrrrError(f"--vocab must be >= 261 (256 bytes + 5 special tokens), got {vocab}")
    if not 0 < val_fraction < 1:
        raise BrrrError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    with _progress(show_progress) as progress:
        files, roots, stats = collect(sources, val_fraction, max_file_kb * 1024, progress)
        sample = tokenizer_sample(files, int(tokenizer_sample_mb * 1e6))
        if progress:
            progress.console.print(f"training a {vocab}-token BPE on {sum(map(len, sample)) / 1e6:.1f} MB "
                                   f"({len(sample)} files)")
        tok = build_tokenizer(sample, vocab, show_progress=show_progress)
        write_tokenizer_files(tok, out, max_length=None)  # the trainer's export adds the model's context
        encoder = Tokenizer.from_str(tok.to_str())
        encoder.encode_special_tokens = True  # '<|bos|>' written in a source file is text, not a control token
        dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
        splits = {}
        for split in SPLITS:
            chosen = [f for f in files if f.split == split]  # collect() order: grouped by source
            tokens = write_split(encoder, chosen, out / f"{split}.bin", out / f"{split}.idx", dtype, progress)
            splits[split] = {"file": f"{split}.bin", "index": f"{split}.idx", "tokens": tokens, "docs": len(chosen)}
    manifest = {
        "format": FORMAT, "created_by": f"brrr {__version__} data build", "vocab_size": tok.get_vocab_size(),
        "dtype": np.dtype(dtype).name, "special_tokens": special_ids(tok),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "tokenizer_training_bytes": sum(map(len, sample)), "val_fraction": val_fraction,
        "max_file_kb": max_file_kb, "splits": splits, "sources": _source_summary(files, roots),
        "scanned_files": stats.scanned, "skipped_files": stats.skipped,
        "files": [{"source": f.source, "path": f.relpath, "split": f.split, "bytes": len(f.text.encode()),
                   "tokens": f.tokens} for f in files],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _source_summary(files: list[SourceFile], roots: dict) -> list[dict]:
    """Per source: roots, files, bytes, and its [start, end) token range in each split (sources are contiguous)."""
    summary, cursor = {}, {s: 0 for s in SPLITS}
    for f in files:
        s = summary.setdefault(f.source, {"name": f.source, "roots": roots[f.source], "files": 0, "bytes": 0,
                                          **{sp: {"tokens": 0, "docs": 0, "range": None} for sp in SPLITS}})
        s["files"] += 1
        s["bytes"] += len(f.text.encode())
    for split in SPLITS:
        for name, s in summary.items():
            n = sum(f.tokens for f in files if f.source == name and f.split == split)
            s[split] = {"tokens": n, "docs": sum(1 for f in files if f.source == name and f.split == split),
                        "range": [cursor[split], cursor[split] + n]}
            cursor[split] += n
    return list(summary.values())


class _progress:
    """rich progress bars on stderr (or nothing)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.p = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=Console(stderr=True))
        return self.p.__enter__()

    def __exit__(self, *exc):
        return self.p.__exit__(*exc) if self.enabled else False
