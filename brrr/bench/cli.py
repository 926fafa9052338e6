"""`brrr bench <benchmark>`: one `bench` parser; each benchmark lives in its own module.

Adding one (say `brrr bench latency`):
  1. write brrr/bench/latency.py with `register(bench_subparsers)`, which calls
     `bench_subparsers.add_parser("latency", help=...)`, adds its options and `set_defaults(func=cmd)`, where
     cmd(args) returns the exit code (raise BrrrError for bad input: the CLI prints it and exits 2);
  2. keep heavy imports (torch kernels, aiohttp, ...) inside cmd, so `brrr --help` stays fast;
  3. append "brrr.bench.latency" to BENCH_MODULES below.
Code that cannot edit this file can call `register_bench_module("pkg.module")` before the parser is built.
"""
from __future__ import annotations

import importlib

BENCH_MODULES = ["brrr.bench.serve", "brrr.bench.latency", "brrr.bench.throughput", "brrr.bench.kernels",
                 "brrr.bench.guided", "brrr.bench.engine_stats", "brrr.bench.finetune", "brrr.bench.lora",
                 "brrr.bench.train", "brrr.bench.serve_overhead", "brrr.bench.rl"]


def register_bench_module(module: str) -> None:
    """Add a module exposing register(bench_subparsers) to `brrr bench` (idempotent)."""
    if module not in BENCH_MODULES:
        BENCH_MODULES.append(module)


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(m.rsplit(".", 1)[-1] for m in BENCH_MODULES))
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for module in BENCH_MODULES:
        importlib.import_module(module).register(bench_sub)

    def needs_a_benchmark(args) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=needs_a_benchmark)
