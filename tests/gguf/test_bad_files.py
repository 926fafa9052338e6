"""Truncated, corrupt and adversarial GGUF files are refused with a BrrrError naming the key or tensor, quickly
(the header check runs before gguf.GGUFReader, which would loop on a huge array count)."""
import shutil
import struct
import time

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

import brrr
from brrr.errors import BrrrError


def _refused(path, match):
    start = time.perf_counter()
    with pytest.raises(BrrrError, match=match):
        brrr.load(path, device="cpu")
    assert time.perf_counter() - start < 5


@pytest.fixture
def good(gguf_file, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(gguf_file("llama", "q4_0"), path)
    return path


def _patch(path, offset, fmt, value):
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + fmt, data, offset, value)
    path.write_bytes(bytes(data))


def _tensor_info(path, name):
    """The file offsets of tensor `name`'s type and data offset fields."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    pos = t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    return pos, pos + 4


def test_truncated_anywhere(good):
    data = good.read_bytes()
    for cut in (3, 20, 200, len(data) // 2, len(data) - 1):
        good.write_bytes(data[:cut])
        _refused(good, "too short|past the end|truncated")


def test_not_gguf_and_unknown_version(good):
    data = bytearray(good.read_bytes())
    good.write_bytes(b"GGUX" + bytes(data[4:]))
    with pytest.raises(BrrrError, match="not a GGUF file"):
        brrr.load(good, device="cpu")
    _patch(good, 0, "4s", b"GGUF")  # the magic back, then a version no reader knows
    _patch(good, 4, "I", 99)
    _refused(good, "version 99")


@pytest.mark.parametrize("offset, what", [(8, "tensors"), (16, "metadata keys")])
def test_huge_counts(good, offset, what):
    _patch(good, offset, "Q", 1 << 62)
    _refused(good, what)


def test_huge_array_count(tmp_path):
    path = tmp_path / "a.gguf"
    key = b"tokenizer.ggml.tokens"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 8, 1 << 60) + b"\0" * 64)
    _refused(path, "tokenizer.ggml.tokens")


def test_tensor_offset_past_the_end(good):
    _, offset = _tensor_info(good, "blk.1.ffn_down.weight")
    _patch(good, offset, "Q", 1 << 40)
    _refused(good, "blk.1.ffn_down.weight")


def test_unknown_tensor_types(good):
    type_pos, _ = _tensor_info(good, "blk.0.attn_q.weight")
    _patch(good, type_pos, "I", 777)
    _refused(good, "blk.0.attn_q.weight.*unknown ggml type 777")
    _patch(good, type_pos, "I", 20)  # IQ4_NL: a real type of Q4_0's block size brrr does not read
    _refused(good, "blk.0.attn_q.weight.*IQ4_NL")


def test_unknown_architecture_names_the_key(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(path, "general.architecture.*'gpt2'")


def test_missing_shape_key_names_it(good):
    data = good.read_bytes()
    key = b"llama.block_count"
    good.write_bytes(data.replace(key, b"llama.blXck_count"))
    _refused(good, "'llama.block_count' is missing")
