"""Speculative decoding's arithmetic (docs/speculative.md derives it). With each draft token accepted independently
with probability alpha, a run of k drafts emits 1 + (accepted prefix) tokens; its expectation is
  E[tokens per run] = (1 - alpha^(k+1)) / (1 - alpha),
and with c the cost of one draft token relative to one target decode step (a verify step of k+1 tokens costing about
one decode step while decoding is memory-bound), the speedup over plain decoding is
  S = (1 - alpha^(k+1)) / ((1 - alpha) (1 + k c)).
With per-position acceptance r_i instead (accepted drafts at position i / runs, as vLLM reports it; r_i = alpha^i
for independent drafts), E = 1 + r_1 + ... + r_k and S = E / (1 + k c).
`brrr calc spec` tabulates both over k; c is given, or comes from the roofline (brrr.analysis.serve.decode_step) of
a draft model's shape, or of the target's EAGLE head: one decoder layer of the target's shape, the fc that mixes
[embedding, feature] (2H -> H) and the target's LM head, which the head shares and reads on every draft step."""
from __future__ import annotations

import dataclasses
import math

from brrr.analysis.formats import weight_format
from brrr.analysis.hardware import GPU
from brrr.analysis.model import prefill_flops_per_token
from brrr.analysis.serve import decode_step
from brrr.config import ModelConfig
from brrr.config.speculative import MAX_SPECULATIVE_TOKENS
from brrr.errors import BrrrError


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


# -- brrr calc spec: per-position rates, the draft/target cost ratio on the roofline, the table over k --------

MAX_K = MAX_SPECULATIVE_TOKENS  # the most draft tokens speculative_config takes


def check_rates(rates: list[float]) -> None:
    """Per-position acceptance must lie in [0, 1] and never rise (accepting position i needs position i - 1)."""
    if not rates:
        raise BrrrError("--acceptance needs at least one rate")
    if len(rates) > MAX_K:
        raise BrrrError(f"--acceptance gives {len(rates)} per-position rates; at most {MAX_K} (the most draft "
                        "tokens brrr speculates)")
    for i, r in enumerate(rates):
        if not 0 <= r <= 1 or math.isnan(r):
            raise BrrrError(f"--acceptance: rate {i + 1} is {r}; each rate must be in [0, 1]")
        if i and r > rates[i - 1] + 1e-12:
            raise BrrrError(f"--acceptance: per-position rates must not increase (position {i + 1}: {r} > "
                            f"position {i}: {rates[i - 1]}); they are accepted-at-position / drafts, as vLLM "
                            "reports them")


def position_rates(acceptance: float, k: int) -> list[float]:
    """r_i = a^i: position i is accepted when it and every earlier position are, each with probability a."""
    return [acceptance ** i for i in range(1, k + 1)]


def tokens_from_rates(rates: list[float], k: int) -> float:
    """E = 1 + r_1 + ... + r_k."""
    if k > len(rates):
        raise BrrrError(f"k={k} needs {k} per-position acceptance rates, {len(rates)} given")
    return 1 + sum(rates[:k])


def eagle_head_config(target: ModelConfig) -> ModelConfig:
    """The shape whose decode step costs what an EAGLE head's does, fc aside: one decoder layer of the target
    plus the target's LM head (shared, but read again on every draft step)."""
    return dataclasses.replace(target, num_layers=1, dense_mlp_layers=())


def draft_step_seconds(draft: ModelConfig, gpu: GPU, batch: int, context: int, weight_dtype: str,
                       eagle: bool = False) -> float:
    """Roofline time of one draft step; an EAGLE head adds its fc (2H -> H) matmul."""
    step = decode_step(draft, gpu, batch, context, weight_dtype=weight_dtype)["step_s"]
    if eagle:
        fmt = weight_format(weight_dtype)
        h = draft.hidden_size
        fc_s = max(fmt.matrix_bytes(h, 2 * h) / gpu.bandwidth, 2 * batch * 2 * h * h / gpu.peak(fmt.compute_dtype))
        step += fc_s
    return step


def cost_ratio(target: ModelConfig, draft: ModelConfig | None, gpu: GPU, batch: int = 1, context: int = 4096,
               weight_dtype: str = "bf16") -> dict:
    """c = one draft step / one target decode step on the roofline. draft None: the target's EAGLE head."""
    target_s = decode_step(target, gpu, batch, context, weight_dtype=weight_dtype)["step_s"]
    eagle = draft is None
    draft_cfg = eagle_head_config(target) if eagle else draft
    draft_s = draft_step_seconds(draft_cfg, gpu, batch, context, weight_dtype, eagle)
    return {"target_step_s": target_s, "draft_step_s": draft_s, "cost_ratio": draft_s / target_s}


def spec_plan(acceptance: float | None = None, rates: list[float] | None = None, cost: float = 0.0,
              ks=range(1, 9)) -> dict:
    """E and S for each k, and the k with the highest S. Give one acceptance rate a, or per-position rates."""
    if (acceptance is None) == (rates is None):
        raise BrrrError("give --acceptance as one rate a, or as per-position rates r_1,r_2,...")
    if not 0 <= cost or math.isnan(cost) or math.isinf(cost):
        raise BrrrError(f"--cost-ratio must be a finite number >= 0, got {cost}")
    if rates is not None:
        check_rates(rates)
        ks = [k for k in ks if k <= len(rates)]
    elif not 0 <= acceptance <= 1:
        raise BrrrError(f"--acceptance must be in [0, 1], got {acceptance}")
    rows = []
    for k in ks:
        if not 1 <= k <= MAX_K:
            raise BrrrError(f"-k {k} must be in [1, {MAX_K}]")
        e = tokens_per_run(acceptance, k) if rates is None else tokens_from_rates(rates, k)
        rows.append({"k": k, "expected_tokens": e, "speedup": e / (1 + k * cost)})
    best = max(rows, key=lambda r: r["speedup"])
    return {"acceptance": acceptance, "position_rates": rates, "cost_ratio": cost, "rows": rows, "best_k": best["k"],
            "best_speedup": best["speedup"]}


def eagle_training_flops_per_token(target: ModelConfig, seq_len: int) -> float:
    """`brrr train-draft` FLOPs per token: the frozen target's forward (its logits are the soft labels), then the
    head's forward and backward (2x) with its fc, except that the shared LM head's weight takes no gradient (its
    backward is the input gradient alone: 1x)."""
    head = eagle_head_config(target)
    head_forward = prefill_flops_per_token(head, seq_len) + 2 * 2 * target.hidden_size ** 2
    lm_head = 2 * target.hidden_size * target.vocab_size
    return prefill_flops_per_token(target, seq_len) + 3 * head_forward - lm_head
