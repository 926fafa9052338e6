"""brrr: serve, shrink, train and measure large language models."""
__version__ = "0.1.0"

from brrr.config import ModelConfig  # noqa: E402
from brrr.engine.llm import LLM  # noqa: E402
from brrr.errors import BrrrError  # noqa: E402
from brrr.generate import forward_logits, generate_tokens  # noqa: E402
from brrr.loader import load_model, save_model  # noqa: E402
from brrr.pretrained import Pretrained, load  # noqa: E402
from brrr.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from brrr.tokenizer import Tokenizer  # noqa: E402

__all__ = ["LLM", "BrrrError", "ModelConfig", "Pretrained", "SamplingParams", "StructuredOutputsParams", "Tokenizer",
           "forward_logits", "generate_tokens", "load", "load_model", "save_model", "__version__"]

