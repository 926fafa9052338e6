"""Speculative decoding: proposers (n-gram prompt lookup, a draft model, EAGLE heads) behind one interface
(proposer.py); the engine verifies their drafts (brrr/engine/spec/verify.py, docs/speculative.md)."""
from __future__ import annotations

from brrr.config.speculative import SpeculativeConfig
from brrr.engine.spec.proposer import Proposer, SpecInput
from brrr.errors import BrrrError

__all__ = ["Proposer", "SpecInput", "make_proposer", "parse_speculative_config"]


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """`--speculative-config '<json>'` (vLLM's flag): the config, None when not given, BrrrError when malformed."""
    if text is None:
        return None
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BrrrError(f"--speculative-config is not valid JSON ({e}): {text!r}") from None
    return SpeculativeConfig.from_dict(value)


def make_proposer(config: SpeculativeConfig, target) -> Proposer:
    """The proposer `config.method` names, for the target model `target` (its config and device, which a draft
    model or an EAGLE head must match). Imports are lazy: a method's dependencies load only when it is used."""
    if config.method == "ngram":
        from brrr.engine.spec.ngram import NgramProposer  # each method's code loads only when it is used
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft":
        try:
            from brrr.engine.spec.draft import DraftModelProposer  # loaded when used (a model of its own)
        except ImportError as e:
            raise BrrrError(f"speculative_config.method 'draft' is not available in this build ({e})") from e
        return DraftModelProposer(config.model, target)
    if config.method == "eagle":
        try:
            from brrr.engine.spec.eagle import EagleProposer  # loaded when used (the head's model code)
        except ImportError as e:
            raise BrrrError(f"speculative_config.method 'eagle' is not available in this build ({e})") from e
        # a tensor-parallel shard's whole vocabulary on rank 0, where the head drafts (distributed/tp_loader.py)
        return EagleProposer(config.model, getattr(target, "draft_target", target))
    raise BrrrError(f"speculative_config.method {config.method!r} is unknown")
