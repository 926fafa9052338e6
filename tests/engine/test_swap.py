"""Swap preemption: the flags and EngineConfig fields that turn it on, and their checks."""
import argparse

import pytest

from brrr.config import EngineConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.errors import BrrrError


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_kv_cache_args(parser)
    return parser.parse_args(list(argv))


def test_the_flags_reach_the_engine_config():
    args = parse("--swap-space", "1.5", "--preemption-mode", "swap")
    config = EngineConfig(**kv_cache_config(args))
    assert (config.swap_space, config.preemption_mode) == (1.5, "swap")
    off = EngineConfig(**kv_cache_config(parse()))
    assert (off.swap_space, off.preemption_mode) == (0.0, None)


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "lots"])
def test_a_negative_or_unreadable_swap_space_names_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        parse("--swap-space", value)
    assert "--swap-space" in capsys.readouterr().err


def test_engine_config_checks_name_the_field():
    with pytest.raises(BrrrError, match=r"swap_space \(--swap-space\) must be a number of GiB >= 0, got -1"):
        EngineConfig(swap_space=-1)
    with pytest.raises(BrrrError, match="preemption_mode"):
        EngineConfig(swap_space=1, preemption_mode="offload")
    with pytest.raises(BrrrError, match="preemption_mode='swap' needs swap_space > 0"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(BrrrError, match="swap_space does not combine with speculative_config"):
        EngineConfig(swap_space=1, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(BrrrError, match="swap_space does not combine"):
        EngineConfig(swap_space=1, kv_eviction="streaming", kv_budget=64)
    # recompute forced: the host memory is unused, so nothing conflicts
    assert EngineConfig(swap_space=1, preemption_mode="recompute", kv_eviction="streaming",
                        kv_budget=64).preemption_mode == "recompute"
