"""Calibration: token sequences from a brrr data directory (its memmapped train split) or a text file; a forward
pass that records what each projection sees, over the whole model or one decoder layer at a time."""
from __future__ import annotations

import sysconfig
from contextlib import contextmanager
from pathlib import Path

import torch

from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.quant.linear import projections
from brrr.token_data import TokenData
from brrr.tokenizer import Tokenizer


def calibration_tokens(source: str | Path, tokenizer, n_samples: int = 128, seq_len: int = 256,
                       split: str = "train") -> torch.Tensor:
    """[n, seq_len] int64: consecutive non-overlapping windows of `source` (a data dir or a text file)."""
    tokens = load_tokens(source, tokenizer, split)
    n = min(n_samples, len(tokens) // seq_len)
    if n == 0:
        raise BrrrError(f"--calib {source}: {len(tokens)} tokens, fewer than one calibration sequence of {seq_len}")
    return tokens[: n * seq_len].view(n, seq_len)


def load_tokens(source: str | Path | None, tokenizer, split: str = "train") -> torch.Tensor:
    """A text file is tokenized with `tokenizer` (the model's); a data directory's token ids are used as they are,
    so its tokenizer must be the model's (checked unless tokenizer is None)."""
    if source is None:
        raise BrrrError("calibration data is required for this method: pass --calib DIR|FILE")
    path = Path(source)
    if path.is_dir():
        data = TokenData(path)
        if tokenizer is not None and Tokenizer.from_dir(path).vocab() != tokenizer.vocab():
            example = Path(sysconfig.get_paths()["stdlib"]) / "json"
            raise BrrrError(f"{path} holds token ids of its own tokenizer ({data.vocab_size} tokens, "
                            f"{path / 'tokenizer.json'}), not this model's ({tokenizer.vocab_size} tokens): the model "
                            "would read them as other tokens. Pass a text file instead (brrr tokenizes it with the "
                            f"model's tokenizer; e.g. `cat {example}/*.py > calib.txt`), or the data directory the "
                            "model was trained on")
        if split not in data.splits:
            raise BrrrError(f"{path}: no {split!r} split (has {', '.join(data.splits)})")
        return torch.from_numpy(data.splits[split].astype("int64"))
    if not path.is_file():
        raise BrrrError(f"data not found: {path} (expected a brrr data directory or a text file)")
    return torch.tensor(tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False),
                        dtype=torch.int64)


def _chunks(model, seqs: torch.Tensor, batch: int):
    """(input ids, positions, attention metadata) of each batch of calibration sequences, on the model's device."""
    device = next(model.parameters()).device
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        yield (chunk.flatten().to(device), torch.arange(chunk.shape[1], device=device).repeat(len(chunk)),
               AttnMeta.causal([chunk.shape[1]] * len(chunk), device))


@torch.no_grad()
def run_model(model, seqs: torch.Tensor, batch: int = 8):
    """Float forward of every sequence (the hooks attached to the model do the recording)."""
    for ids, positions, meta in _chunks(model, seqs, batch):
        model(ids, positions, meta)


class Recorded(Exception):
    """Ends a batch of a layer's replay once what it records is seen (`recording(..., stop=True)`)."""


@contextmanager
def recording(model, on_input, only: set[str] | None = None, stop: bool = False):
    """Within the block, on_input(name, x [tokens, in_features]) for each projection's input (those in `only`, if
    given) in every forward pass; stop: then end the pass (a `layer_by_layer` replay: the rest of the layer is not
    run)."""
    def hook(name, x):
        on_input(name, x.float())
        if stop:
            raise Recorded

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(name, args[0]))
               for name, m in projections(model) if only is None or name in only]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record_inputs(model, seqs: torch.Tensor, on_input, only: set[str] | None = None) -> None:
    """on_input(name, x) for each projection's input (those in `only`) during a forward pass over `seqs`."""
    with recording(model, on_input, only):
        run_model(model, seqs)


@torch.no_grad()
def layer_by_layer(model, seqs: torch.Tensor, batch: int = 8):
    """Yield (i, layer, replay) for each decoder layer in order: replay() runs layer i over the calibration data's
    stream as it reaches that layer, through the layers before it as the caller left them (GPTQ: quantized). After
    the caller's turn the stream moves on through layer i as it is then. Each layer runs twice; a whole forward
    pass for each layer ran the trunk L(L+1)/2 times."""
    stream = []  # per batch: [h, residual, cos, sin, meta]
    for ids, positions, meta in _chunks(model, seqs, batch):
        h, cos, sin = model.model.embed(ids, positions)
        stream.append([h, None, cos, sin, meta])
    for i, layer in enumerate(model.model.layers):
        @torch.no_grad()  # the caller calls it, outside this generator's no_grad
        def replay(layer=layer):
            for h, residual, cos, sin, meta in stream:
                try:
                    layer(h, cos, sin, meta, residual)
                except Recorded:
                    pass
        yield i, layer, replay
        for s in stream if i + 1 < len(model.model.layers) else ():
            s[0], s[1] = layer(s[0], s[2], s[3], s[4], s[1])
