"""The typed record of one engine step: what the scheduler chose, which rows to sample and how, which rows' logits
the features want, and each feature's own additions. Built in `plan`, run in `execute`, applied in `commit`."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from brrr.engine.sampler import PendingTokens, SampleRow
from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.sequence import Sequence


class SampleSlot(NamedTuple):
    """One token to draw: row `row` of the flattened batch, for `seq`, `offset` tokens past its last committed one
    (0 for an ordinary step; 1..d for the verified positions of d draft tokens; 1 in a step planned ahead). A tuple:
    a step makes one per sequence, and the host's time per step is what the device waits on."""
    row: int
    seq: Sequence
    offset: int = 0


@dataclass
class StepPlan:
    batch: ScheduledBatch
    # None: one slot a sequence, its only row, one token ahead (a decode planned behind the step in flight; no
    # tuple a sequence is kept alive across a host step for it)
    slots: list[SampleSlot] | None = field(default_factory=list)
    rows: list[SampleRow] = field(default_factory=list)  # how each slot samples, in slot order
    multi_token: bool = False  # some sequence has several slots (a verified run): its tokens are one run
    logit_rows: list[int] = field(default_factory=list)  # rows whose log-probabilities a feature reads
    want_hidden: bool = False  # the model's output rows are kept for a feature (an EAGLE proposer)
    # a step planned before the previous one's tokens reached the host: its input ids are those tokens, gathered on
    # the device from these (device tokens, their rows)
    ids_from: tuple[torch.Tensor, torch.Tensor] | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # feature name -> what it added to this step

    def release_rows(self) -> list[SampleRow]:
        """The rows, handed to a sampling launched now: the plan keeps no reference (a step in flight is alive
        across a host step, and objects that outlive a garbage-collector generation make its collections dear)."""
        rows, self.rows = self.rows, []
        return rows

    def each_slot(self):
        """(row, seq, offset) of every slot, in order."""
        if self.slots is None:
            return ((i, seq, 1) for i, (seq, _) in enumerate(self.batch.items))
        return self.slots

    @property
    def sequences(self) -> list[Sequence]:
        return [seq for seq, _ in self.batch.items]


@dataclass
class StepResult:
    tokens: list[int]  # per slot
    logprobs: list  # per slot: {token: logprob} or None
    logits_logprobs: torch.Tensor | None = None  # log-softmax of the plan's logit_rows
    hidden: torch.Tensor | None = None  # with want_hidden: the model's output, one row per flattened token


@dataclass
class InFlight:
    """A step handed to the device. `done` holds its result when it ran synchronously; `pending` its tokens still on
    the device; `logits` a forward whose sampling waits for `mask` (a bitmask a feature fills while the device runs)."""
    plan: StepPlan
    done: StepResult | None = None
    pending: PendingTokens | None = None
    logits: torch.Tensor | None = None
    mask: Future | None = None

    def live(self) -> bool:
        return any(not seq.finished for seq in self.plan.sequences)
