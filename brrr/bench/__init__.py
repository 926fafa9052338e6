"""Benchmarks: `brrr bench serve` (load generator against an OpenAI-compatible server) and the synthetic
workloads in datasets.py; see brrr/bench/cli.py for how a new `brrr bench <name>` plugs in."""
