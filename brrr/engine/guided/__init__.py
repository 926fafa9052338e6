"""Guided (structured) decoding: grammars compiled from StructuredOutputsParams (backend.py), one matcher per
sequence, and the token bitmask applied to the logits in the sampler (bitmask.py). docs/structured-outputs.md."""
from brrr.engine.guided.backend import GrammarCompiler, GuidedMatcher, compile_cache_info, compiler_for
from brrr.engine.guided.bitmask import apply_token_bitmask, fill_bitmask

__all__ = ["GrammarCompiler", "GuidedMatcher", "apply_token_bitmask", "compile_cache_info", "compiler_for",
           "fill_bitmask"]
