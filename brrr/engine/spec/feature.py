"""Speculative decoding as a plug-in feature of the engine step (core/feature.py): before each planned step the
proposer drafts (Speculator.propose); a speculating decode is scheduled with its drafts and every verified position
is sampled; the run keeps the accepted prefix (Speculator.accept), and its rejected drafts' cache slots are dropped.
The rules of acceptance and why outputs equal decoding without speculation: spec/verify.py."""
from __future__ import annotations

import logging

import torch

from brrr.engine.block_manager import BlockManager
from brrr.engine.core.feature import Feature
from brrr.engine.core.plan import SampleSlot, StepPlan, StepResult
from brrr.engine.scheduler import ScheduledBatch, Scheduler
from brrr.engine.sequence import Sequence
from brrr.engine.spec.verify import Speculator
from brrr.engine.spec.verify_graphs import graph_replays

log = logging.getLogger("brrr.engine")


class Speculation(Feature):
    name = "spec"

    def __init__(self, speculator: Speculator, scheduler: Scheduler, block_manager: BlockManager,
                 max_model_len: int, runner=None):
        self.spec, self.scheduler, self.block_manager = speculator, scheduler, block_manager
        self.max_model_len, self.runner = max_model_len, runner  # runner: for its verify graphs' counters

    def _speculating(self) -> bool:
        """Whether the next step may verify drafts: then no decode step is launched ahead of it (the drafts follow
        tokens the host has not read yet). Not while the proposer is idle (`Speculator.idle`)."""
        running, spec = self.scheduler.running, self.spec
        return (spec.enabled(len(running)) and not spec.idle() and any(spec.speculates(seq) for seq in running))

    def _draft_room(self, seq: Sequence) -> int:
        """The most drafts seq may verify: a run emits drafts + 1 tokens, within max_tokens and the context."""
        left = seq.request.params.max_tokens - seq.num_output_tokens - 1
        return min(left, self.max_model_len - len(seq.token_ids))

    def propose(self, running):
        self.spec.propose(running, self._draft_room)

    def contribute(self, plan, seq, n, row, slots):
        plan.want_hidden = plan.want_hidden or self.spec.needs_hidden
        drafts = len(seq.spec_tokens)
        if drafts:  # a verified run: every position is sampled, each keyed by its own output index
            return [SampleSlot(row + i, seq, i) for i in range(drafts + 1)]
        return slots

    def allows_launch(self, plan: StepPlan) -> bool:
        # the proposer reads this step's hidden states, which a captured decode graph does not keep
        return not (self.spec.needs_hidden and self._speculating())

    def allows_ahead(self, plan: StepPlan) -> bool:
        return not self._speculating()  # the next step proposes from this step's tokens: it waits for them

    def launched_ahead(self, plan: StepPlan) -> None:
        self.spec.launched_ahead()

    def consume(self, plan, result, runs):
        """Drafts the step read on the device get their values; each verified run keeps its accepted prefix (its
        logprobs are those of the tokens the target drew at each position: the emitted ones)."""
        self.spec.resolve(plan.sequences)
        kept = {}
        for i, (seq, tokens, logprobs) in enumerate(runs):
            if seq.spec_tokens:
                tokens = self.spec.accept(seq.spec_tokens, tokens)
                runs[i] = (seq, tokens, logprobs)
                kept[seq.seq_id] = len(tokens)
        if kept:
            self.spec.num_verify_steps += 1
        plan.extras[self.name] = kept
        return runs

    def owns_commit(self, plan: StepPlan, seq: Sequence) -> bool:
        return seq.seq_id in plan.extras.get(self.name, ())

    def after_append(self, plan, seq, tokens, record) -> None:
        """After a verified run: its last committed token and the accepted drafts stay in the KV cache; the rejected
        drafts' slots are dropped, and their blocks freed when the run crossed a block boundary. A run a stop cut
        short has finished and freed everything already."""
        if seq.seq_id not in plan.extras.get(self.name, ()) or seq.finished:
            return
        seq.num_computed_tokens += len(tokens)
        self.block_manager.truncate(seq, len(seq.token_ids))
        self.block_manager.commit_computed(seq, seq.request.cache_key)

    def finish_step(self, plan: StepPlan, result: StepResult):
        if result.hidden is not None:
            self._keep_hidden(plan.batch, plan.extras.get(self.name, {}), result.hidden)
        for seq in self.scheduler.running:  # drafts live one step (a decode the budget left out drops its own too)
            seq.drop_drafts()
        return []

    def _keep_hidden(self, batch: ScheduledBatch, kept: dict[int, int], hidden: torch.Tensor) -> None:
        """Each running sequence's hidden states for the positions this step computed and kept (EAGLE reads them
        at its next propose): a prefill chunk's every row, a decode's one, a verified run's accepted prefix."""
        start = 0
        for seq, n in batch.items:
            if not seq.finished and self.spec.speculates(seq):
                self.spec.keep_hidden(seq.seq_id, hidden[start:start + kept.get(seq.seq_id, n)])
            start += n

    def release(self, seq: Sequence) -> None:
        self.spec.release(seq)

    def stats(self) -> dict:
        return {**self.spec.stats(), **(graph_replays(self.runner, self.spec.proposer) if self.runner else {})}
