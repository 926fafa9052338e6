"""Checkpoints of a distributed run through torch.distributed.checkpoint (DCP).

Each rank writes only its own shards (FSDP shards, TP slices, its pipeline stages); the metadata records every
tensor by its plain-model name and global shape, so a checkpoint written under one layout loads under any other
(4 ranks FSDP -> 2 ranks FSDP x TP -> one process): each rank reads the pieces that overlap its new shards. The
trainer's counters go beside it in trainer.json. A save goes to a temporary directory renamed into place once
complete, so a crash mid-save keeps the previous checkpoint. One process writes the single-file format
(brrr.train.checkpoint) and reads either.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from brrr.errors import BrrrError
from brrr.train import checkpoint as single

DCP_DIR = "dcp"
SINGLE_FILE = "state.pt"


def checkpoint_path(out: Path, distributed: bool) -> Path:
    return Path(out) / "checkpoint" / (DCP_DIR if distributed else SINGLE_FILE)


def has_checkpoint(out: Path) -> bool:
    """Whether OUT holds a run's checkpoint, in either format."""
    return any(checkpoint_path(out, d).exists() for d in (False, True))


def _options(flat: bool, frozen_out: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # the optimizer's hyperparameters one entry per parameter ("param_groups.<name>.lr", torchtitan's choice), not
    # groups listing their parameters' names: each rank saves and loads those of the parameters it holds, which
    # under --ep differ between ranks (its own experts)
    # frozen_out: the frozen base is neither saved nor expected back (strict would ask for it)
    return StateDictOptions(flatten_optimizer_state_dict=flat, ignore_frozen_params=frozen_out,
                            strict=not frozen_out)


def _module(model):
    """(the module DCP's state-dict API takes, whether its frozen parameters are left out): a checkpointed object
    that is no module (an adapter run's trainable tensors, brrr.train.finetune.TrainableState) gives its model,
    whose frozen base the checkpoint does not hold."""
    return (model, False) if isinstance(model, nn.Module) else (model.module, True)


def _state(model, optimizer, flat: bool = True) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    module, frozen_out = _module(model)
    msd, osd = get_state_dict(module, optimizer, options=_options(flat, frozen_out))
    return {"model": msd, "optimizer": osd}


def _flat(path: Path) -> bool:
    """Whether a DCP checkpoint's optimizer is stored flat (checkpoints written before were not: their entries
    are per group, "optimizer.param_groups.0.lr")."""
    import torch.distributed.checkpoint as dcp

    return "optimizer.param_groups.0.lr" not in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _barrier():
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Writes this run's checkpoints (DCP when distributed, sync or async) and reads either format."""

    def __init__(self, out: Path, distributed: bool, main: bool, async_save: bool = False):
        self.out, self.distributed, self.main, self.async_save = Path(out), distributed, main, async_save
        self.path = checkpoint_path(out, distributed)
        self._pending = None  # the future of an async save still writing
        # an async save runs its collectives from a background thread: on a group of its own, since one group's
        # collectives must not interleave between threads
        self._group = dist.new_group(backend="gloo") if async_save and distributed else None

    def exists(self) -> bool:
        return has_checkpoint(self.out)

    def save(self, model, optimizer, trainer_state: dict):
        if not self.distributed:
            if self.main:
                single.save(self.path, model, optimizer, trainer_state)
                shutil.rmtree(checkpoint_path(self.out, True), ignore_errors=True)
            return
        import torch.distributed.checkpoint as dcp

        self.wait()
        tmp = self.path.with_name(DCP_DIR + ".tmp")
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "trainer.json").write_text(json.dumps(trainer_state) + "\n")
        _barrier()
        state = _state(model, optimizer)
        if self.async_save:  # the tensors are staged to CPU now; the files are written while training goes on
            self._pending = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._finalize()

    def wait(self):
        """Block until an async save has been written and moved into place."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._finalize()

    def _finalize(self):
        _barrier()  # every rank's shards are on disk
        if self.main:
            tmp, old = self.path.with_name(DCP_DIR + ".tmp"), self.path.with_name(DCP_DIR + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if self.path.exists():
                self.path.rename(old)
            tmp.rename(self.path)
            shutil.rmtree(old, ignore_errors=True)
            (self.out / "checkpoint" / SINGLE_FILE).unlink(missing_ok=True)
        _barrier()

    def load(self, model, optimizer) -> dict:
        """Restore model and optimizer in place from whichever checkpoint exists; returns the trainer state."""
        dcp_dir, file = checkpoint_path(self.out, True), checkpoint_path(self.out, False)
        if dcp_dir.is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            flat = _flat(dcp_dir)
            state = _state(model, optimizer, flat)
            dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=not dist.is_initialized())
            module, frozen_out = _module(model)
            set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=_options(flat, frozen_out))
            return json.loads((dcp_dir / "trainer.json").read_text())
        if file.is_file() and self.distributed:
            raise BrrrError(f"--resume: {file} was written by one process; a torchrun launch resumes from a DCP "
                            f"checkpoint ({dcp_dir}). Continue it with one process, or start a new --out")
        return single.load(file, model, optimizer)


def load_model_weights(model, path: Path):
    """The model tensors of a DCP checkpoint into a plain (unsharded) model, in this process alone: how rank 0
    exports the HF directory whatever the training layout was."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
