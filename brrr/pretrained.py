"""`brrr.load(...)`: a model, its tokenizer and its stop tokens, ready for reference generation."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from brrr.errors import BrrrError
from brrr.generate import generate_tokens
from brrr.hub import resolve_model
from brrr.loader import load_model
from brrr.sampling_params import SamplingParams
from brrr.tokenizer import IncrementalDecoder, Tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | torch.device | None) -> torch.device:
    """The device to load onto (None: cuda if available, else cpu), refused with a BrrrError when this machine's
    torch cannot use it, before anything is loaded."""
    if device is None:
        return torch.device(default_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise BrrrError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise BrrrError(f"--device {device}: {why}; use --device cpu (or install a CUDA build of torch)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BrrrError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise BrrrError(f"--device {device}: brrr runs on cpu or cuda")
    return dev


@dataclass
class Pretrained:
    path: Path
    model: torch.nn.Module
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]

    @property
    def config(self):
        return self.model.config

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas as tokens are sampled. `prompt`: text, token ids, or chat messages (through the template)."""
        params = params or SamplingParams()
        decoder = IncrementalDecoder(self.tokenizer)
        for token in self.generate_ids(prompt, params):
            yield decoder.push(token)

    def generate(self, prompt, params: SamplingParams | None = None) -> str:
        return "".join(self.stream(prompt, params))

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
            return self.tokenizer.encode_chat(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BrrrError("prompt must be a string, a list of token ids, or a list of chat messages")

    def generate_ids(self, prompt, params: SamplingParams) -> Iterator[int]:
        return generate_tokens(self.model, self.prompt_ids(prompt), params, self.eos_token_ids)


def load(model: str | Path | None = None, dtype=None, device: str | None = None) -> Pretrained:
    device = check_device(device)
    path = resolve_model(model)
    net = load_model(path, dtype=dtype, device=device)
    tokenizer = Tokenizer.from_dir(path)
    return Pretrained(path, net, tokenizer, stop_token_ids(path, net.config, tokenizer))


def stop_token_ids(path: Path, cfg, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The model's EOS ids: its config's, generation_config.json's and the tokenizer's."""
    eos = set(cfg.eos_token_ids)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise BrrrError(f"{gen_file} is not valid JSON: {e}") from None
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))
