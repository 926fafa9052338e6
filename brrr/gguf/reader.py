"""Open a GGUF file: bounds-check its header against the file size, then parse it with `gguf.GGUFReader`.

The reader trusts the counts and lengths a file states: an array length of 2**60 makes it loop for ever, a tensor
offset past the end gives a short memory map. So before handing a file to it, `check_header` walks the header once
(struct reads on a memory map, nothing allocated per entry beyond Python ints) and refuses any count, length, type
or offset that the file's size cannot hold, naming the key or tensor. Then the reader's own exceptions become
BrrrError too. Tensors stay memory-mapped: `GGUFTensor.data` is the reader's numpy view of the file (opened
copy-on-write, so torch.from_numpy gets a writable array and the file is never written)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from brrr.errors import BrrrError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays: llama.cpp writes none; allow one level
DEFAULT_ALIGNMENT = 32
_SCALAR_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


def is_gguf(path) -> bool:
    """A path names a GGUF file: by its suffix, or by its magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first): the reverse of ggml's ne
    data: np.ndarray        # memory-mapped: float arrays for F32/F16, else the raw blocks as uint8 [rows, row bytes]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


class _Header:
    """A cursor over the memory-mapped header; every read is checked against the file's end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise BrrrError(f"{self.path}: {what} needs {n} bytes at offset {self.pos}, past the end of the "
                            f"{self.size}-byte file (truncated or corrupt)")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", f"the length of {what}")
        self.need(n, what)
        out = bytes(self.buf[self.pos:self.pos + n]) if n <= 4096 else b""
        self.pos += n
        return out

    def value(self, vtype: int, key: str, depth: int = 0):
        """Skip one value of `vtype`, checking its size; returns it for small scalars (alignment), else None."""
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise BrrrError(f"{self.path}: metadata key {key!r} has unknown value type {vtype}") from None
        if vtype in _SCALAR_SIZES:
            fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR_SIZES[vtype]]
            return self.unpack(fmt, f"metadata key {key!r}")
        if vtype == GGUFValueType.STRING:
            self.string(f"metadata key {key!r}")
            return None
        # an array: element type, count, elements
        if depth >= MAX_NESTING:
            raise BrrrError(f"{self.path}: metadata key {key!r} nests arrays deeper than {MAX_NESTING}")
        etype, count = self.unpack("I", f"metadata key {key!r}"), self.unpack("Q", f"metadata key {key!r}")
        try:
            etype = GGUFValueType(etype)
        except ValueError:
            raise BrrrError(f"{self.path}: metadata key {key!r} is an array of unknown type {etype}") from None
        if etype in _SCALAR_SIZES:
            self.need(count * _SCALAR_SIZES[etype], f"metadata key {key!r} ({count} elements)")
            self.pos += count * _SCALAR_SIZES[etype]
            return None
        # strings (8-byte length each) or arrays (12 bytes each at least): the count is bounded by what is left
        least = 8 if etype == GGUFValueType.STRING else 12
        self.need(count * least, f"metadata key {key!r} ({count} elements)")
        for _ in range(count):
            self.value(etype, key, depth + 1)
        return None


def check_header(path: Path) -> None:
    """Refuse a file whose header states more than the file holds (see the module docstring)."""
    size = path.stat().st_size
    if size < 24:
        raise BrrrError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes at least)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = _Header(buf, path)
        if bytes(buf[:4]) != MAGIC:
            raise BrrrError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
        h.pos = 4
        version = h.unpack("I", "the version")
        if version not in VERSIONS:
            raise BrrrError(f"{path}: GGUF version {version} is not supported (brrr reads versions 2 and 3, "
                            "little-endian)")
        n_tensors, n_kv = h.unpack("Q", "the tensor count"), h.unpack("Q", "the metadata count")
        # each metadata entry takes 12 bytes at least (key length, value type), each tensor 24 (name length,
        # dimension count, type, offset): counts past that cannot be real
        if n_kv * 12 > size:
            raise BrrrError(f"{path}: header states {n_kv} metadata keys, more than a {size}-byte file can hold")
        if n_tensors * 24 > size:
            raise BrrrError(f"{path}: header states {n_tensors} tensors, more than a {size}-byte file can hold")
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = h.string(f"metadata key #{i}").decode("utf-8", "replace")
            vtype = h.unpack("I", f"the type of metadata key {key!r}")
            value = h.value(vtype, key)
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32 or not value or value & (value - 1):
                    raise BrrrError(f"{path}: metadata key 'general.alignment' must be a power-of-two uint32, "
                                    f"got {value!r}")
                alignment = value
        tensors = []
        for i in range(n_tensors):
            name = h.string(f"tensor #{i}'s name").decode("utf-8", "replace")
            n_dims = h.unpack("I", f"tensor {name!r}'s dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise BrrrError(f"{path}: tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
            dims = [h.unpack("Q", f"tensor {name!r}'s shape") for _ in range(n_dims)]
            raw_type, offset = h.unpack("I", f"tensor {name!r}'s type"), h.unpack("Q", f"tensor {name!r}'s offset")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise BrrrError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if any(d == 0 for d in dims) or dims[0] % block:
                raise BrrrError(f"{path}: tensor {name!r} has shape {dims} (ggml order); {qtype.name} needs every "
                                f"dimension > 0 and the first a multiple of {block}")
            n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
            tensors.append((name, offset, n_bytes))
        data_start = -(-h.pos // alignment) * alignment
        for name, offset, n_bytes in tensors:
            if offset % alignment:
                raise BrrrError(f"{path}: tensor {name!r} starts at offset {offset}, not a multiple of the "
                                f"alignment {alignment}")
            if data_start + offset + n_bytes > size:
                raise BrrrError(f"{path}: tensor {name!r} ({n_bytes} bytes at data offset {offset}) ends past the "
                                f"end of the {size}-byte file (truncated?)")


class GGUFFile:
    """A GGUF file's metadata (key -> Python value) and tensors (name -> GGUFTensor), memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise BrrrError(f"GGUF file not found: {self.path}")
        check_header(self.path)
        try:
            reader = GGUFReader(self.path, "c")  # copy-on-write: writable arrays for torch, the file untouched
        except Exception as e:  # the reader raises ValueError/KeyError/IndexError on what the check cannot see
            raise BrrrError(f"{self.path}: cannot read GGUF: {type(e).__name__}: {e}") from None
        self.metadata: dict = {}
        for key, f in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = f.contents()
            except Exception as e:
                raise BrrrError(f"{self.path}: metadata key {key!r} cannot be decoded: {e}") from None
        self.tensors = {t.name: GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data)
                        for t in reader.tensors}

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", str)

    def get(self, key: str, typ=None, default=...):
        """The value of `key`, checked to be `typ` (int accepts any integer type; float accepts ints)."""
        if key not in self.metadata:
            if default is ...:
                raise BrrrError(f"{self.path}: required metadata key {key!r} is missing")
            return default
        value = self.metadata[key]
        if typ is None:
            return value
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if typ is int and isinstance(value, bool) or not isinstance(value, typ):
            raise BrrrError(f"{self.path}: metadata key {key!r} must be {typ.__name__}, got "
                            f"{type(value).__name__} {str(value)[:80]}")
        return value


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), parsed once per file version: config, tokenizer and weights all read the same header."""
    p = Path(path).resolve()
    if not p.is_file():
        raise BrrrError(f"GGUF file not found: {path}")
    st = p.stat()
    return _open(p, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _open(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)
