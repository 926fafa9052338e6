"""A finished `brrr data build` directory (its layout: brrr/train/data.py), read: the manifest checked, each split's
token ids a read-only memmap. Training, calibration (brrr/quant/calib.py) and benchmarks read one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from brrr.errors import BrrrError

FORMAT = "brrr-tokens-v1"


class TokenData:
    """A finished data directory, validated against its manifest; splits are read-only memmaps."""

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        file = path / "manifest.json"
        if not path.is_dir():
            raise BrrrError(f"--data {path}: directory not found")
        if not file.is_file():
            raise BrrrError(f"--data {path} has no manifest.json (not a finished data build); "
                            f"make one with `brrr data build --out {path}`")
        try:
            self.manifest = m = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise BrrrError(f"{file} is not valid JSON: {e}") from None
        if m.get("format") != FORMAT:
            raise BrrrError(f"{file}: field 'format' is {m.get('format')!r}, expected {FORMAT!r}")
        self.tokenizer_file = path / "tokenizer.json"
        if not self.tokenizer_file.is_file():
            raise BrrrError(f"--data {path}: tokenizer.json is missing")
        if hashlib.sha256(self.tokenizer_file.read_bytes()).hexdigest() != m["tokenizer_sha256"]:
            raise BrrrError(f"{self.tokenizer_file} is not the tokenizer this data was encoded with "
                            "(its sha256 differs from manifest.json's tokenizer_sha256); rebuild the data")
        self.dtype = np.dtype(m["dtype"])
        self.splits = {}
        for split, info in m["splits"].items():
            bin_file = path / info["file"]
            expected = info["tokens"] * self.dtype.itemsize
            if not bin_file.is_file() or bin_file.stat().st_size != expected:
                have = bin_file.stat().st_size if bin_file.is_file() else "missing"
                raise BrrrError(f"{bin_file}: expected {expected} bytes ({info['tokens']} tokens), found {have}")
            self.splits[split] = np.memmap(bin_file, dtype=self.dtype, mode="r") if info["tokens"] else \
                np.zeros(0, self.dtype)

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def special_tokens(self) -> dict:
        return self.manifest["special_tokens"]

    def source_ranges(self, split: str) -> dict[str, tuple[int, int]]:
        return {s["name"]: tuple(s[split]["range"]) for s in self.manifest["sources"] if s[split]["tokens"]}

    def documents(self, split: str) -> np.ndarray:
        return np.fromfile(self.path / self.manifest["splits"][split]["index"], dtype=np.uint64)
