"""`build_engine`: the one place an engine is assembled from a model and an EngineConfig, for `LLM`, `brrr serve`'s
engine process and the benches: a plain core, a tensor-parallel one (rank 0's shard here, the workers started), or a
disaggregated one (the decode instance here, the prefill instances started), with or without the output processor."""
from __future__ import annotations

from brrr.config import EngineConfig
from brrr.distributed.disagg_engine import load_disaggregated
from brrr.distributed.tp_loader import load_pretrained
from brrr.engine.core import EngineCore
from brrr.engine.llm_engine import LLMEngine
from brrr.pretrained import load


def build_engine(model, dtype, device, config: EngineConfig, core: bool = False):
    """(the loaded Pretrained, the engine): an EngineCore when `core` (the engine process sends its records on),
    else an LLMEngine over it (outputs assembled in this process). model: a directory, a hub id, or None for the
    shipped default."""
    if config.disaggregate is not None:  # the decode instance here, the prefill instances in processes of their own
        pretrained, engine = load_disaggregated(model, dtype, device, config)
    else:
        if config.tensor_parallel_size > 1:  # rank 0's shard here, the others in worker processes
            pretrained, config = load_pretrained(model, dtype, device, config)
        else:
            pretrained = load(model, dtype=dtype, device=device)
        engine = EngineCore(pretrained.model, pretrained.tokenizer, config, pretrained.eos_token_ids)
    return pretrained, engine if core else LLMEngine(core=engine)
