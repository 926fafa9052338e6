from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.models.llama import LlamaForCausalLM

FAMILIES = {"llama": LlamaForCausalLM}


def model_class(cfg: ModelConfig):
    if not cfg.runnable:
        raise BrrrError(f"architecture {cfg.architecture!r} can be described (brrr calc) but not run by brrr yet")
    return FAMILIES[cfg.family]
