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

Every pick made on a GPU is also written to a JSON file per GPU model (`TunedConfigStore`: under $BRRR_CACHE_DIR,
else $XDG_CACHE_HOME/brrr, else ~/.cache/brrr), as soon as it is made, and read back by the next process: a second
start of the same model tunes nothing. The file's name holds a fingerprint of this package's sources and the
torch/triton versions, so a changed kernel or candidate list is tuned again (vLLM ships its fused-MoE picks as
per-GPU JSON files the same way; here they are made on the user's own GPU).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from brrr.cache_dir import cache_dir
from brrr.kernels.dispatch import next_power_of_2
from brrr.kernels.graph_timing import graph_time_us
from brrr.kernels.quant.configs import LIMITS
from brrr.kernels.quant.launch import INTERPRETED

log = logging.getLogger("brrr.kernels")
CHAIN_CALLS = 16  # launches in a timed decode chain
TUNED_ELSEWHERE = ("fused_moe.py",)  # brrr/kernels modules outside this package whose configs are tuned here

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


@functools.lru_cache(maxsize=1)
def sources_fingerprint() -> str:
    """12 hex digits of a hash of this package's sources (kernels, plans, candidate lists) and the torch and triton
    versions: a tuned pick is reused only by the code that timed it."""
    import triton

    h = hashlib.sha256(f"{torch.__version__} {triton.__version__}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(here, name) for name in sorted(os.listdir(here)) if name.endswith(".py")]
    paths += [os.path.join(os.path.dirname(here), name) for name in TUNED_ELSEWHERE]
    for path in paths:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    return h.hexdigest()[:12]


class TunedConfigStore:
    """The tuned picks of one directory on disk: a JSON file per GPU model, {repr(shape): {bucket: config}}.
    Read once per device name; each new pick is merged into the file at once (a warm-up cut short keeps what it
    tuned). Only CUDA devices by default (`devices`): CPU runs never tune unless a test passes a timer."""

    def __init__(self, directory: str | None = None, devices: tuple[str, ...] = ("cuda",)):
        self.directory, self.devices = directory, devices
        self._loaded: dict[str, dict] = {}

    def _name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def path(self, device: torch.device) -> str:
        name = "".join(c if c.isalnum() else "_" for c in self._name(device))
        return os.path.join(self.directory or os.path.join(cache_dir(), "tuned_configs"),
                            f"{name}-{sources_fingerprint()}.json")

    def picks(self, device: torch.device) -> dict:
        """{repr(shape): {bucket: config}} on disk for `device` ({} when none or unreadable)."""
        if device.type not in self.devices:
            return {}
        path = self.path(device)
        if path not in self._loaded:
            self._loaded[path] = self._read(path)
        return self._loaded[path]

    @staticmethod
    def _read(path: str) -> dict:
        try:
            with open(path) as f:
                raw = json.load(f)
            return {shape: {int(b): dict(cfg) for b, cfg in buckets.items()} for shape, buckets in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as e:  # a torn or foreign file: tune again
            log.warning("ignoring the tuned-config file %s (%s); its shapes are tuned again", path, e)
            return {}

    def save(self, device: torch.device, shape: tuple, b: int, config: dict) -> None:
        if device.type not in self.devices:
            return
        path = self.path(device)
        picks = self.picks(device)
        picks.setdefault(repr(shape), {})[b] = config
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            merged = self._read(path)  # another process may have added shapes since this one read the file
            for shape_key, buckets in picks.items():
                merged.setdefault(shape_key, {}).update(buckets)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({s: {str(k): c for k, c in bs.items()} for s, bs in merged.items()}, f, indent=0)
            os.replace(tmp, path)
        except OSError as e:  # a read-only home: the picks still hold for this process
            log.warning("could not write the tuned-config file %s (%s)", path, e)


@dataclass
class _Session:
    timer: Timer
    report: TuningReport


class TunedConfigs:
    """Tuned configs by (device, shape) and bucket, and the tuning session in progress (None outside
    `quant_tuning`). Lookups of untuned buckets are memoised until the next session ends."""

    def __init__(self, store: TunedConfigStore | None = None):
        self.store = store or TunedConfigStore()
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
        if tuned is None:  # first lookup of the shape in this process: what an earlier one tuned
            tuned = self._tuned[(device, shape)] = dict(self.store.picks(device).get(repr(shape), {}))
        if b in tuned:
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
        session, t0 = self._session, time.perf_counter()
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
        if timed:
            self.store.save(device, shape, b, pick)
        log.info("tuned %s at M bucket %d: %d of %d configs timed in %.1f s", shape, b, len(timed), len(configs),
                 time.perf_counter() - t0)
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
        """Forget every tuned config of this process (tests); the store's files stay."""
        self._tuned.clear()
        self._fallbacks.clear()


TUNED_CONFIGS = TunedConfigs()


def quant_tuning(timer: Timer | None = None):
    """`TUNED_CONFIGS.tuning`: wrap warm-up work in it, so the quantized matmuls it runs are tuned there; outside
    it they never time anything."""
    return TUNED_CONFIGS.tuning(timer)
