"""The inline PTX of the quantized kernels, as text: each snippet is built for one packed 16-bit type (`BF16`,
`F16`), and the kernels pick theirs by x's dtype (one `inline_asm_elementwise` call per type: Triton cannot select
the asm string). The idea throughout: a code becomes a float without an int-to-float instruction, by placing its
bits under the exponent bits of a power of two (a "magic number") and subtracting that power."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Packed16:
    """A packed pair type's constants, in both 16-bit halves: 1.0, -1.0, the magic number (128 for bf16, whose 7
    mantissa bits hold a code under 2^7; 1024 for fp16), and the PTX type name."""
    one: str
    nego: str
    magic: str
    kind: str


BF16 = Packed16(one="0x3F803F80", nego="0xBF80BF80", magic="0x43004300", kind="bf16x2")
F16 = Packed16(one="0x3C003C00", nego="0xBC00BC00", magic="0x64006400", kind="f16x2")


def _block(lines: list[str]) -> str:
    return "{\n" + "\n".join(lines) + "\n}"


def int8_to_16bit(t: Packed16) -> str:
    """int8 -> 16-bit, 4 bytes at a time ($2 in; $0, $1 two packed pairs): flip the sign bits (q + 128), one prmt
    per byte builds the fp32 2^23 + q + 128 (the byte under the exponent bits 0x4B), one subtraction makes it q,
    one cvt packs two: 2.75 instructions a weight."""
    return _block([".reg .b32 u, magic, f0, f1, f2, f3;", "xor.b32 u, $2, 0x80808080;", "mov.b32 magic, 0x4B000000;"]
                  + [f"prmt.b32 f{i}, u, magic, 0x744{i};" for i in range(4)]
                  + [f"sub.f32 f{i}, f{i}, 0f4B000080;" for i in range(4)]
                  + [f"cvt.rn.{t.kind}.f32 $0, f1, f0;", f"cvt.rn.{t.kind}.f32 $1, f3, f2;"])


# Each half of a 32-bit word under the exponent bits of 2^23 ($2 in; $0 bits 0-15, $1 bits 16-31): one prmt each
HALVES = _block([".reg .b32 magic;", "mov.b32 magic, 0x4B000000;", "prmt.b32 $0, $2, magic, 0x7610;",
                 "prmt.b32 $1, $2, magic, 0x7632;"])
# Each byte b of a word ($4) as the fp32 bits of 2^23 + (b ^ 0x80): one xor a word, one prmt a byte ($0-$3)
BYTES = _block([".reg .b32 u, magic;", "xor.b32 u, $4, 0x80808080;", "mov.b32 magic, 0x4B000000;"]
               + [f"prmt.b32 ${i}, u, magic, 0x754{i};" for i in range(4)])
# Ask L2 for the line at $1 when $2 is set; nothing waits for it ($0: a dummy result)
PREFETCH_L2 = "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }"


def word_nibbles(word: str, regs: tuple, out: tuple, nz: tuple, magic: str, kind: str) -> list[list[str]]:
    """PTX turning one 32-bit word of packed codes into four bf16x2/f16x2 pairs q - z, in four stages (callers
    converting two words interleave them stage by stage): two prmt and two shifts spread the nibbles into the
    16-bit halves of `regs` (bytes 0-1 low, 2-3 low, 0-1 high, 2-3 high nibbles), four lop3 OR in `magic` (128
    or 1024, so each half reads magic + q) and four fma add nz = -(magic + z) into `out`. Needs registers
    `zero` (0) and `one` (1.0 in both halves)."""
    t0, t1, u0, u1 = regs
    return [[f"prmt.b32 {t0}, {word}, zero, 0x4140;", f"prmt.b32 {t1}, {word}, zero, 0x4342;"],
            [f"shr.b32 {u0}, {t0}, 4;", f"shr.b32 {u1}, {t1}, 4;"],
            [f"lop3.b32 {r}, {r}, 0x000F000F, {magic}, 0xEA;" for r in regs],
            [f"fma.rn.{kind} {o}, {r}, one, {n};" for o, r, n in zip(out, regs, nz)]]


def nibbles(t: Packed16) -> str:
    """`codes_minus_zero`'s PTX: 4 bytes ($4) and the rows' -(magic + z) pairs ($5, $6) -> the low and high
    nibbles' q - z as packed pairs ($0-$3)."""
    lines = [".reg .b32 zero, one, t0, t1, u0, u1;", "mov.b32 zero, 0;", f"mov.b32 one, {t.one};"]
    for stage in word_nibbles("$4", ("t0", "t1", "u0", "u1"), ("$0", "$1", "$2", "$3"), ("$5", "$6") * 2,
                              t.magic, t.kind):
        lines += stage
    return _block(lines)


def mma_gemv_w4(t: Packed16) -> str:
    """The int4 MMA GEMV's group: one thread's 4 words of tiles A and B ($8-$11, $12-$15), x at each word's low and
    high columns ($16-$19, $20-$23, 8 bytes each), the rows' -(magic + z) pairs ($24, $28), scales / 4 ($32, $36)
    and accumulators ($40-$47 in, $0-$7 out; the group's sum goes to the first of each row's four)."""
    kind, magic = t.kind, t.magic
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind[:-2]}.{kind[:-2]}.f32"
    body = []
    for m in range(4):
        tile_a = word_nibbles(f"${8 + m}", ("t0", "t1", "u0", "u1"), ("t0", "t1", "u0", "u1"), ("$24",) * 4,
                              magic, kind)
        tile_b = word_nibbles(f"${12 + m}", ("v0", "v1", "y0", "y1"), ("v0", "v1", "y0", "y1"), ("$28",) * 4,
                              magic, kind)
        for a, b in zip(tile_a, tile_b):
            body += a + b
        body += [f"mov.b64 {{xa, xb}}, ${16 + m};",
                 f"{mma} {{d0, d1, d2, d3}}, {{t0, v0, t1, v1}}, {{xa, xb}}, {{d0, d1, d2, d3}};",
                 f"mov.b64 {{xa, xb}}, ${20 + m};",
                 f"{mma} {{e0, e1, e2, e3}}, {{u0, y0, u1, y1}}, {{xa, xb}}, {{e0, e1, e2, e3}};"]
    head = [".reg .b32 zero, one, t0, t1, u0, u1, v0, v1, y0, y1, xa, xb;",
            ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3;", "mov.b32 zero, 0;", f"mov.b32 one, {t.one};"]
    head += [f"mov.f32 {r}, 0f00000000;" for r in ("d0", "d1", "d2", "d3", "e0", "e1", "e2", "e3")]
    tail = ["add.f32 d0, d0, e0;", "add.f32 d2, d2, e2;", "fma.rn.f32 $0, d0, $32, $40;",
            "fma.rn.f32 $4, d2, $36, $44;"] + [f"mov.b32 ${i}, ${40 + i};" for i in (1, 2, 3, 5, 6, 7)]
    return _block(head + body + tail)


MMA_GEMV_W4_IO = ",".join(["=f"] * 8 + ["r"] * 8 + ["l"] * 8 + ["r"] * 8 + ["f"] * 16)


def word_bytes(word: str, lo: str, hi: str, magic: str, kind: str) -> list[str]:
    """PTX turning one word of 4 signed bytes into the packed pairs (q0, q1) in `lo` and (q2, q3) in `hi`: each
    byte pair spread into 16-bit halves (prmt), its low 7 bits ORed into magic and its sign bit into magic or
    2 x magic (bf16's 7 mantissa bits cannot hold a signed byte under one OR); their difference is q, exactly.
    Needs registers `zero` (0), `nego` (-1.0 in both halves) and scratch `l7`, `sg`."""
    out = []
    for reg, sel in ((lo, "0x4140"), (hi, "0x4342")):
        out += [f"prmt.b32 {reg}, {word}, zero, {sel};",
                f"lop3.b32 l7, {reg}, 0x007F007F, {magic}, 0xEA;",
                f"lop3.b32 sg, {reg}, 0x00800080, {magic}, 0xEA;",
                f"fma.rn.{kind} {reg}, sg, nego, l7;"]
    return out


def word_fp8(word: str, lo: str, hi: str, kind: str) -> list[str]:
    """PTX turning one word of 4 E4M3 bytes into the exact pairs (b0, b1) in `lo` and (b2, b3) in `hi`. fp16:
    one cvt a pair. bf16 has no such cvt on sm_90: each byte goes to the top of a 16-bit half (prmt), its low 7
    bits move down under bf16's exponent and mantissa (E4M3's 4 + 3 bits as the low bits of bf16's 8 + 7), the
    sign stays, and a multiply by 2^120 moves E4M3's exponent bias (7) to bf16's (127); E4M3's subnormals are
    bf16 subnormals there, exact too. Needs registers `zero` (0), `big` (2^120, bf16) and scratch `sg`; fp16
    needs 16-bit `h0`, `h1`."""
    if kind == "f16x2":
        return [f"mov.b32 {{h0, h1}}, {word};", f"cvt.rn.f16x2.e4m3x2 {lo}, h0;", f"cvt.rn.f16x2.e4m3x2 {hi}, h1;"]
    out = []
    for reg, sel in ((lo, "0x1404"), (hi, "0x3424")):
        out += [f"prmt.b32 {reg}, {word}, zero, {sel};", f"shr.b32 sg, {reg}, 4;", "and.b32 sg, sg, 0x07F007F0;",
                f"lop3.b32 {reg}, {reg}, 0x80008000, sg, 0xEA;", f"fma.rn.bf16x2 {reg}, {reg}, big, nzero;"]
    return out


def mma_gemv_w8(t: Packed16, fp8: bool = False) -> str:
    """The int8 (fp8: E4M3) MMA GEMV's step: a thread's 4 words of tiles A and B ($8-$11, $12-$15), x at each
    word's 4 columns ($16-$19, 8 bytes each), accumulators $20-$27 in and $0-$7 out (each row's running sum in the
    first of a thread's four; the MMA's C operand, so no add per step)."""
    kind = t.kind
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind[:-2]}.{kind[:-2]}.f32"
    body = []
    for m in range(4):
        d = "d" if m % 2 == 0 else "e"  # two accumulator chains
        if fp8:
            body += word_fp8(f"${8 + m}", "t0", "t1", kind) + word_fp8(f"${12 + m}", "v0", "v1", kind)
        else:
            body += word_bytes(f"${8 + m}", "t0", "t1", t.magic, kind)
            body += word_bytes(f"${12 + m}", "v0", "v1", t.magic, kind)
        body += [f"mov.b64 {{xa, xb}}, ${16 + m};",
                 f"{mma} {{{d}0, {d}1, {d}2, {d}3}}, {{t0, v0, t1, v1}}, {{xa, xb}}, {{{d}0, {d}1, {d}2, {d}3}};"]
    # fp8: `word_fp8`'s registers too (2^120 and -0.0 as bf16 pairs, the fp16 cvt's 16-bit halves)
    fp8_regs = [".reg .b32 big, nzero;", ".reg .b16 h0, h1;"] if fp8 else []
    fp8_movs = ["mov.b32 big, 0x7B807B80;", "mov.b32 nzero, 0x80008000;"] if fp8 else []
    head = [".reg .b32 zero, nego, t0, t1, v0, v1, l7, sg, xa, xb;",
            ".reg .f32 d0, d1, d2, d3, e0, e1, e2, e3;", *fp8_regs, "mov.b32 zero, 0;", f"mov.b32 nego, {t.nego};",
            *fp8_movs, "mov.f32 d0, $20;", "mov.f32 d2, $24;"]
    head += [f"mov.f32 {r}, 0f00000000;" for r in ("d1", "d3", "e0", "e1", "e2", "e3")]
    tail = ["add.f32 $0, d0, e0;", "add.f32 $4, d2, e2;"]
    tail += [f"mov.b32 ${i}, ${20 + i};" for i in (1, 2, 3, 5, 6, 7)]
    return _block(head + body + tail)


MMA_GEMV_W8_IO = ",".join(["=f"] * 8 + ["r"] * 8 + ["l"] * 4 + ["f"] * 8)
