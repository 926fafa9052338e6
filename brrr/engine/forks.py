"""n > 1 samples of one prompt: the prompt is computed once, and in the step that completes it the request forks
n - 1 more sequences that share its blocks, each sampled from the same last prompt row with its own key. A plug-in
feature of the engine step (core/feature.py); the scheduler creates and places the forks."""
from __future__ import annotations

from brrr.engine.core.feature import Feature
from brrr.engine.core.plan import SampleSlot, StepPlan
from brrr.engine.scheduler import Scheduler
from brrr.engine.sequence import Request


class Forks(Feature):
    name = "forks"
    per_request = True

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def wants(self, request: Request) -> bool:
        return request.params.n > 1

    def contribute(self, plan, seq, n, row, slots):
        if (len(slots) == 1 and slots[0].offset == 0 and seq.request.params.n > 1
                and len(seq.request.seqs) == 1):  # the prompt completes this step: fork
            children = self.scheduler.make_forks(seq)
            plan.extras.setdefault(self.name, []).append((seq, children))
            slots = slots + [SampleSlot(slots[0].row, child) for child in children]
        return slots

    def allows_launch(self, plan: StepPlan) -> bool:
        return all(seq.request.params.n == 1 for seq in plan.sequences)

    def after_computed(self, plan: StepPlan) -> None:
        """The parents' prompts are committed: the forks share those blocks from here."""
        for parent, children in plan.extras.get(self.name, ()):
            self.scheduler.admit_forks(parent, children)
