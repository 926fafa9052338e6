"""Speculative decoding's arithmetic (docs/speculative.md derives it). With each draft token accepted independently
with probability alpha, a run of k drafts emits 1 + (accepted prefix) tokens; its expectation is
  E[tokens per run] = (1 - alpha^(k+1)) / (1 - alpha),
and with c the cost of one draft token relative to one target decode step (a verify step of k+1 tokens costing about
one decode step while decoding is memory-bound), the speedup over plain decoding is
  S = (1 - alpha^(k+1)) / ((1 - alpha) (1 + k c))."""
from __future__ import annotations


def tokens_per_run(alpha: float, k: int) -> float:
    """Expected tokens a verified run of k drafts emits (the bonus/correction token included)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """S = (1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)): tokens per run over the run's cost in decode steps."""
    return tokens_per_run(alpha, k) / (1.0 + k * c)


def fit_alpha(mean_tokens_per_run: float, k: int) -> float:
    """The per-token acceptance alpha whose expected tokens per run is the measured mean (bisection: monotone)."""
    target = min(max(mean_tokens_per_run, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tokens_per_run(mid, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
