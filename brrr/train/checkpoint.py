"""Resumable training state in one file, replaced atomically so a crash mid-write keeps the previous one."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from brrr.errors import BrrrError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, model, optimizer, trainer_state: dict):
    """Model and optimizer tensors, the trainer's counters (step, data position, ...) and every RNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "trainer": trainer_state,
                "rng": rng_state()}, tmp)
    os.replace(tmp, path)


def load(path: Path, model, optimizer) -> dict:
    """Restore model, optimizer and RNGs in place; returns the trainer state."""
    path = Path(path)
    if not path.is_file():
        raise BrrrError(f"--resume: no checkpoint at {path} (a run writes it every --checkpoint-every steps)")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return payload["trainer"]
