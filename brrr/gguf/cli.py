"""`brrr export gguf`: an HF model directory -> a GGUF file llama.cpp, transformers and brrr read."""
from __future__ import annotations

from brrr.gguf.export import export_gguf
from brrr.gguf.writer import FILE_TYPES


def register(sub) -> None:
    p = sub.add_parser("export", help="write a model in another format: gguf (llama.cpp's single file)")
    fmt = p.add_subparsers(dest="export_format", metavar="FORMAT")
    g = fmt.add_parser("gguf", help="an HF model directory -> one .gguf file (weights, config and tokenizer)")
    g.add_argument("--model", required=True, help="HF model directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--out", required=True, help="the .gguf file to write")
    g.add_argument("--type", default="f16", choices=list(FILE_TYPES),
                   help="tensor type of the 2-D weights (norms and biases stay f32); q4_k_m gives output.weight "
                        "and some attn_v/ffn_down Q6_K, as llama.cpp's recipe does (docs/gguf.md)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.set_defaults(func=cmd_export_gguf)


def cmd_export_gguf(args) -> int:
    counts = export_gguf(args.model, args.out, args.type, show_progress=not args.no_progress)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    return 0
