"""Speculative decoding arithmetic: expected tokens per verify step and the speedup over plain decoding.

A proposer drafts k tokens; the target scores them (and one more position) in one verify step and keeps the
longest accepted prefix plus one token of its own, so every verify step yields between 1 and k + 1 tokens.
With r_i the probability that draft position i is accepted (and with it every earlier one: the per-position
acceptance vLLM reports, accepted tokens at position i / drafts), the expected tokens per verify step are
    E = 1 + r_1 + ... + r_k.
When each draft token is accepted independently with probability a, r_i = a^i and
    E = (1 - a^(k+1)) / (1 - a)            (k + 1 at a = 1).
One verify step costs about one target decode step while decoding is memory-bound (k + 1 tokens read the weights
once), and the k draft steps cost k c of it (c: one draft step / one target step), so
    S = E / (1 + k c) = (1 - a^(k+1)) / ((1 - a)(1 + k c)).
c comes from the roofline (brrr.analysis.serve.decode_step) of two model shapes, or of the target's EAGLE head:
one decoder layer of the target's shape, the fc that mixes [embedding, feature] (2H -> H) and the target's
LM head, which the head shares. docs/speculative.md derives all of it and works an example.
"""
from __future__ import annotations

import dataclasses
import math

from brrr.analysis.formats import weight_format
from brrr.analysis.hardware import GPU
from brrr.analysis.model import prefill_flops_per_token
from brrr.analysis.serve import decode_step
from brrr.config import ModelConfig
from brrr.errors import BrrrError

MAX_K = 16  # the engine's MAX_SPECULATIVE_TOKENS


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


def expected_tokens(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens one verify step yields, the target's own token included."""
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def expected_tokens_from_rates(rates: list[float], k: int) -> float:
    """E = 1 + r_1 + ... + r_k."""
    if k > len(rates):
        raise BrrrError(f"k={k} needs {k} per-position acceptance rates, {len(rates)} given")
    return 1 + sum(rates[:k])


def speedup(tokens: float, k: int, cost_ratio: float) -> float:
    """S = E / (1 + k c): tokens per verify step over the time of one verify step plus k draft steps, in target
    decode steps."""
    return tokens / (1 + k * cost_ratio)


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
        e = expected_tokens(acceptance, k) if rates is None else expected_tokens_from_rates(rates, k)
        rows.append({"k": k, "expected_tokens": e, "speedup": speedup(e, k, cost)})
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
