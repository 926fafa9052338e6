"""Autotuning of the quantized matmuls, at warm-up only.

A matmul's config is looked up by (device, shape, bucket of M) in `TUNED_CONFIGS`, the one cache of tuned configs.
Inside `quant_tuning()` (the engine's warm-up: the eager step before each CUDA-graph capture and the warm-up
requests) a lookup that misses times every candidate once and keeps the fastest. Outside it nothing is timed: a
bucket never tuned takes the config tuned for the nearest bucket of the same shape that is a candidate at this M,
else the default (the caller's, or the first candidate: brrr/kernels/quant/configs.py).

Decode shapes (M <= small_m) are timed the way the engine runs them: a CUDA graph of back-to-back launches (PDL
overlaps each with the one before) over copies of the weight that together exceed L2 twice, so every call reads
HBM. Timed alone with L2 flushed (do_bench), near-equal candidates swapped ranks from run to run and the pick could
be the slower one in the step. Larger M: alone, with L2 flushed between runs.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.graph_timing import graph_time_us
from brrr.kernels.quant.configs import LIMITS
from brrr.kernels.quant.launch import INTERPRETED

CHAIN_CALLS = 16  # launches in a timed decode chain

# (run, config, weight copies or None) -> device ms of one run(config); run(config, weight) takes a copy
Timer = Callable[[Callable, dict, "list | None"], float]


def bucket(m: int) -> int:
    """Tuning bucket of M, named by the largest M in it: each M <= gemv_m alone (the GEMV candidates are compiled
    per M and cost grows with M), then the rest of the small-M path, then powers of two."""
    if m <= LIMITS.gemv_m:
        return m
    return LIMITS.small_m if m <= LIMITS.small_m else min(next_power_of_2(m), LIMITS.max_bucket)


def bucket_sizes(max_tokens: int) -> list[int]:
    """One M per tuning bucket up to max_tokens rows (the largest of each, max_tokens itself for the last): the
    token counts a warm-up runs inside `quant_tuning` so that every bucket a step of at most max_tokens can meet
    gets a tuned config."""
    sizes, m = [], 1
    while m <= max_tokens:
        sizes.append(bucket(m))
        m = bucket(m) + 1
        if sizes[-1] >= LIMITS.max_bucket:
            break
    if sizes and sizes[-1] > max_tokens:
        sizes[-1] = max_tokens
    return sizes


def weight_copies(weight: torch.Tensor) -> list:
    """The weight and enough clones (same strides) that the set is at least twice L2."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size or 50 << 20
    n = max(2, min(16, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def time_on_gpu_ms(run, cfg: dict, copies: list | None) -> float:
    """The default `Timer`: a captured chain of CHAIN_CALLS launches cycling over the weight copies, or alone with
    L2 flushed (triton's do_bench) when there are none."""
    if copies:
        calls = [lambda w=copies[i % len(copies)]: run(cfg, w) for i in range(CHAIN_CALLS)]
        return graph_time_us(calls, replays=5) / 1e3
    import triton.testing

    return triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=20)


@dataclass(frozen=True)
class TunedShape:
    """One tuning: the shape's key, its bucket, every candidate's device ms (inf: it failed to run) and the pick."""
    shape: tuple
    bucket: int
    timings: tuple
    config: dict


@dataclass
class TuningReport:
    """What a `quant_tuning` block timed, for the caller that opened it (benchmarks print it)."""
    shapes: list[TunedShape] = field(default_factory=list)


@dataclass
class _Session:
    timer: Timer
    report: TuningReport


class TunedConfigs:
    """Tuned configs by (device, shape) and bucket, and the tuning session in progress (None outside
    `quant_tuning`). Lookups of untuned buckets are memoised until the next session ends."""

    def __init__(self):
        self._tuned: dict[tuple, dict[int, dict]] = {}
        self._fallbacks: dict[tuple, dict] = {}
        self._session: _Session | None = None

    def config(self, device: torch.device, shape: tuple, m: int, candidates: Callable[[], list],
               run: Callable, weight: torch.Tensor | None = None, default: dict | None = None,
               family: Callable[[dict], tuple] | None = None) -> dict:
        """The config for M rows of `shape` on `device`. `candidates()` is called only on a miss (building the list
        costs more than the lookup); run(cfg, weight copy) is what a tuning session times. `default`: what a shape
        with no bucket tuned runs outside a session (else the first candidate, the same for every M of a bucket).
        `family(cfg)`: the launch shape a config varies (tile and warps; its K step, stages and split are the
        variations): a session then times the first config of each family, and the rest of the fastest's only."""
        b = bucket(m)
        tuned = self._tuned.get((device, shape))
        if tuned is not None and b in tuned:
            return tuned[b]
        # never inside a CUDA-graph capture: timing would break it (the eager step before it tuned the shape)
        if self._session is not None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return self._tune(device, shape, b, m, candidates(), run, weight, family)
        if default is not None and not tuned:
            return default
        fallback = self._fallbacks.get((device, shape, b))
        if fallback is None:
            fallback = self._fallbacks[(device, shape, b)] = self._nearest(tuned or {}, b, candidates())
        return fallback

    @staticmethod
    def _nearest(tuned: dict[int, dict], b: int, configs: list) -> dict:
        """The config tuned for the bucket nearest b (in log2 of M; on a tie, the smaller) that is among this M's
        candidates; else the default, the first candidate."""
        for other in sorted(tuned, key=lambda t: (abs(math.log2(t) - math.log2(b)), t)):
            if tuned[other] in configs:
                return tuned[other]
        return configs[0]

    def _tune(self, device, shape: tuple, b: int, m: int, configs: list, run, weight, family=None) -> dict:
        session = self._session
        copies = None
        if len(configs) > 1 and weight is not None and weight.is_cuda and m <= LIMITS.small_m:
            try:
                copies = weight_copies(weight)
            except torch.OutOfMemoryError:  # no room for the copies: timed alone
                copies = None
        timed = []

        def time_all(cfgs):
            for cfg in cfgs:
                try:
                    timed.append((cfg, session.timer(run, cfg, copies)))
                except Exception:  # e.g. a config needing more shared memory than the GPU has
                    timed.append((cfg, float("inf")))
            return min(timed, key=lambda ct: ct[1])[0]

        if len(configs) > 1 and family is None:
            time_all(configs)
        elif len(configs) > 1:  # a coordinate search: every family's first, then the winning family's rest
            heads = {}
            for c in configs:
                heads.setdefault(family(c), c)
            heads = list(heads.values())
            best = time_all(heads)
            time_all([c for c in configs if family(c) == family(best) and c not in heads])
        del copies
        pick = min(timed, key=lambda ct: ct[1])[0] if timed else configs[0]
        self._tuned.setdefault((device, shape), {})[b] = pick
        session.report.shapes.append(TunedShape(shape, b, tuple(timed), pick))
        return pick

    @contextlib.contextmanager
    def tuning(self, timer: Timer | None = None):
        """The block in which lookups that miss are tuned; yields its `TuningReport`. Nested blocks share the outer
        one. Under Triton's interpreter nothing is timed unless a timer is given (tests)."""
        if self._session is not None:
            yield self._session.report
            return
        report = TuningReport()
        if timer is None and INTERPRETED:
            yield report
            return
        self._session = _Session(timer or time_on_gpu_ms, report)
        try:
            yield report
        finally:
            self._session = None
            self._fallbacks.clear()  # the nearest tuned bucket may have changed

    def clear(self) -> None:
        """Forget every tuned config (tests)."""
        self._tuned.clear()
        self._fallbacks.clear()


TUNED_CONFIGS = TunedConfigs()


def quant_tuning(timer: Timer | None = None):
    """`TUNED_CONFIGS.tuning`: wrap warm-up work in it, so the quantized matmuls it runs are tuned there; outside
    it they never time anything."""
    return TUNED_CONFIGS.tuning(timer)
