"""Calibration: token sequences from a brrr data directory (its memmapped train split) or a text file, and one
float forward pass of the model that records what each projection sees."""
from __future__ import annotations

from pathlib import Path

import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.quant.linear import projections


def calibration_tokens(source: str | Path, tokenizer, n_samples: int = 128, seq_len: int = 256,
                       split: str = "train") -> torch.Tensor:
    """[n, seq_len] int64: consecutive non-overlapping windows of `source` (a data dir or a text file)."""
    tokens = load_tokens(source, tokenizer, split)
    n = min(n_samples, len(tokens) // seq_len)
    if n == 0:
        raise BrrrError(f"--calib {source}: {len(tokens)} tokens, fewer than one calibration sequence of {seq_len}")
    return tokens[: n * seq_len].view(n, seq_len)


def load_tokens(source: str | Path | None, tokenizer, split: str = "train") -> torch.Tensor:
    if source is None:
        raise BrrrError("calibration data is required for this method: pass --calib DIR|FILE")
    path = Path(source)
    if path.is_dir():
        from brrr.train.data import TokenData

        data = TokenData(path)
        if split not in data.splits:
            raise BrrrError(f"{path}: no {split!r} split (has {', '.join(data.splits)})")
        return torch.from_numpy(data.splits[split].astype("int64"))
    if not path.is_file():
        raise BrrrError(f"data not found: {path} (expected a brrr data directory or a text file)")
    return torch.tensor(tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False),
                        dtype=torch.int64)


@torch.no_grad()
def run_model(model, seqs: torch.Tensor, batch: int = 8):
    """Float forward of every sequence (the hooks attached to the model do the recording)."""
    device = next(model.parameters()).device
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        ids = chunk.flatten().to(device)
        positions = torch.arange(chunk.shape[1], device=device).repeat(len(chunk))
        model(ids, positions, AttnMeta.causal([chunk.shape[1]] * len(chunk), device))


def record_inputs(model, seqs: torch.Tensor, on_input, only: set[str] | None = None) -> None:
    """Call on_input(name, x [tokens, in_features]) for each projection's input (those in `only`, if given)
    during a forward pass over `seqs`."""
    handles = [m.register_forward_hook(lambda mod, args, out, name=name: on_input(name, args[0].float()))
               for name, m in projections(model) if only is None or name in only]
    try:
        run_model(model, seqs)
    finally:
        for h in handles:
            h.remove()
