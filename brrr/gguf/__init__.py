"""GGUF, llama.cpp's single-file model format, in and out of brrr, through the `gguf` package's reader and writer.

reader.py     open a file: bounds-check the header against the file size, then `gguf.GGUFReader` (memory-mapped)
config.py     `general.*` / `<arch>.*` metadata -> an HF config.json dict (ModelConfig.from_hf reads it)
names.py      llama.cpp tensor names <-> HF names, and the Q/K row permutation llama.cpp's converter applies
dequant.py    torch dequantizers per block type, bit-identical to `gguf.quants.dequantize`
kquants.py    brrr's own Q4_K / Q6_K quantizers (the gguf package has none), and Q8_0 / Q4_0 through gguf.quants
tokenizer.py  `tokenizer.ggml.*` -> a `tokenizers` tokenizer (byte-level BPE or SentencePiece-style BPE) and back
writer.py     HF tensors, config and tokenizer -> a GGUF file with `gguf.GGUFWriter`
repack.py     Q8_0 / Q4_K / Q5_K / Q6_K blocks -> the group-wise layouts of brrr/kernels/quant/groupwise.py, exactly
load.py       a GGUF file -> a brrr model (Q4_0 as int4, Q8_0 / Q4_K-Q6_K group-wise QuantLinear; the rest dequantized)
export.py     `brrr export gguf`: an HF directory -> a GGUF file
docs/gguf.md teaches the format."""
from brrr.gguf.reader import GGUFFile, is_gguf, open_gguf

__all__ = ["GGUFFile", "is_gguf", "open_gguf"]
