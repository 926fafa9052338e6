"""`brrr calc spec`: the speculative-decoding formulas at their limits, against a simulation, and through the CLI."""
import random

import pytest

from brrr.analysis.hardware import get_gpu
from brrr.analysis.spec_decode import (cost_ratio, expected_speedup, position_rates, spec_plan, tokens_from_rates,
                                       tokens_per_run)
from brrr.errors import BrrrError
from brrr.presets import preset_config
from tests.analysis.test_cli import calc


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.5])
def test_limits(k, c):
    # a -> 0: every draft rejected, one token per verify that cost 1 + k c target steps
    assert expected_speedup(1e-12, k, c) == pytest.approx(1 / (1 + k * c))
    assert tokens_per_run(0.0, k) == 1
    # a = 1: every draft accepted, k + 1 tokens per verify
    assert tokens_per_run(1.0, k) == k + 1
    assert expected_speedup(1.0, k, c) == pytest.approx((k + 1) / (1 + k * c))
    # continuity at a = 1 of the closed form
    assert tokens_per_run(1 - 1e-9, k) == pytest.approx(k + 1, rel=1e-6)


def test_closed_form_is_the_sum_of_position_rates():
    for a in (0.1, 0.5, 0.9):
        for k in range(1, 9):
            assert tokens_per_run(a, k) == pytest.approx(tokens_from_rates(position_rates(a, k), k))


def test_monte_carlo_matches_expected_tokens():
    """Simulated verify steps: each draft token accepted with probability a until the first rejection; the target
    adds its own token either way."""
    rng = random.Random(0)
    trials = 40_000
    for a, k in ((0.3, 2), (0.7, 4), (0.9, 8)):
        total = 0
        for _ in range(trials):
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
            total += accepted + 1
        mean = total / trials
        # tokens per step lie in [1, k + 1]: their standard deviation is at most k / 2; allow 5 standard errors
        assert abs(mean - tokens_per_run(a, k)) < 5 * (k / 2) / trials**0.5, (a, k, mean)


def test_best_k_and_bad_input():
    r = spec_plan(acceptance=0.8, cost=0.05)
    assert [row["k"] for row in r["rows"]] == list(range(1, 9))
    assert r["best_speedup"] == max(row["speedup"] for row in r["rows"])
    assert spec_plan(acceptance=0.5, cost=1.0)["best_k"] == 1  # a draft as slow as the target never pays
    with pytest.raises(BrrrError, match="must not increase"):
        spec_plan(rates=[0.5, 0.7], cost=0.1)
    with pytest.raises(BrrrError, match=r"in \[0, 1\]"):
        spec_plan(acceptance=1.5, cost=0.1)
    with pytest.raises(BrrrError, match="cost-ratio"):
        spec_plan(acceptance=0.5, cost=-1)


def test_cost_ratio_from_the_roofline():
    target, gpu = preset_config("llama-3.1-8b"), get_gpu("h100")
    small = cost_ratio(target, preset_config("llama-3.2-1b"), gpu)
    assert 0 < small["cost_ratio"] < 1
    head = cost_ratio(target, None, gpu)  # EAGLE: one layer + fc + the 128k-vocabulary LM head of an 8B
    assert head["target_step_s"] == small["target_step_s"]
    assert 1 / 32 < head["cost_ratio"] < 0.2  # more than a layer's share: the LM head is read on every draft step


def test_cli(capsys):
    code, out = calc(["spec", "--acceptance", "0.8", "--cost-ratio", "0.05", "-k", "4", "--json"], capsys)
    assert code == 0 and out["k"] == 4 and out["best_k"] == 8
    assert out["rows"][3]["expected_tokens"] == pytest.approx((1 - 0.8**5) / 0.2)
    code, out = calc(["spec", "--acceptance", "0.9,0.6,0.3", "--target", "llama-3.1-8b", "--draft", "eagle",
                      "--gpu", "h100"], capsys)
    assert code == 0 and "EAGLE head" in out and "best k" in out
    with pytest.raises(BrrrError, match="cost ratio"):
        calc(["spec", "--acceptance", "0.8"], capsys)


def test_cli_takes_an_eagle_head_directory_as_the_draft(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["EagleHead"]}')
    _, by_dir = calc(["spec", "--acceptance", "0.7", "--target", "llama-3.1-8b", "--draft", str(tmp_path), "--json"],
                     capsys)
    _, by_name = calc(["spec", "--acceptance", "0.7", "--target", "llama-3.1-8b", "--draft", "eagle", "--json"], capsys)
    assert by_dir["cost_ratio"] == by_name["cost_ratio"]
