"""The plug-in interface of the engine step. A feature (speculation, structured-output masks, prompt logprobs, LoRA
rows, n > 1 forks) hooks into the three phases and keeps its own state, keyed by sequence id:

  plan     `propose` before the scheduler runs; `contribute` per scheduled item (its sample slots, logit rows,
           hidden states); `sample_row` (how a slot samples); `allows_launch` / `allows_ahead` / `defers_sampling`
           (whether the step may keep its tokens on the device, have the next step queued behind it, or sample
           after a mask it fills while the device runs); `model_inputs` (the plan's per-item model input)
  execute  `launched_ahead` when a step is queued behind another
  commit   `consume` (the step's result, before anything is committed: accept drafts, read log-probs), `owns_commit`
           (a sequence whose computed tokens it commits itself), `after_computed`, `finish_reason` (per appended
           token), `after_append` (per sequence), `finish_step` (extra records), `after_step` (the next step is
           queued)

A feature is in the step only while it is on: an engine-wide one (speculation) from the start, a per-request one
(`per_request`, with `wants`) while a request that uses it is live. Every hook's default does nothing."""
from __future__ import annotations

from brrr.engine.core.plan import InFlight, SampleSlot, StepPlan, StepResult
from brrr.engine.outputs import EngineOutput
from brrr.engine.sampler import SampleRow
from brrr.engine.sequence import Request, Sequence


HOOKS = ("propose", "contribute", "sample_row", "model_inputs", "allows_launch", "allows_ahead", "defers_sampling",
         "launched_ahead", "consume", "owns_commit", "after_computed", "finish_reason", "after_append", "finish_step",
         "after_step", "adopt", "release")


def hooked(features: list["Feature"]) -> dict[str, list["Feature"]]:
    """hook name -> the features that implement it (override the default), in order: the step calls a hook only on
    those, so a hook no feature implements costs nothing."""
    return {hook: [f for f in features if getattr(type(f), hook) is not getattr(Feature, hook)] for hook in HOOKS}


class Feature:
    name = "feature"
    per_request = False  # on only while a request it `wants` is live

    def wants(self, request: Request) -> bool:
        return True

    # ---- plan ------------------------------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Before the scheduler plans a step (raising fails the running requests, not the engine)."""

    def contribute(self, plan: StepPlan, seq: Sequence, n: int, row: int,
                   slots: list[SampleSlot]) -> list[SampleSlot]:
        """The sample slots of a scheduled item (n tokens from flattened row `row`); `slots` is what the engine and
        the features before this one chose. May add to plan.logit_rows, plan.want_hidden and plan.extras."""
        return slots

    def sample_row(self, seq: Sequence, offset: int, row: SampleRow) -> SampleRow:
        """How seq samples `offset` tokens past its last committed one (the engine's row, to change or replace)."""
        return row

    def model_inputs(self, plan: StepPlan) -> None:
        """The plan is made (its slots and rows chosen, a step planned ahead included): set plan.batch.row_values,
        the per-item value the runner's row input gives each of the item's rows (staging.RowInput)."""

    def allows_launch(self, plan: StepPlan) -> bool:
        """Whether the step may run with its tokens left on the device (read back after the next is queued)."""
        return True

    def allows_ahead(self, plan: StepPlan) -> bool:
        """Whether the next step may be planned before this one's tokens reach the host."""
        return True

    def defers_sampling(self, plan: StepPlan) -> bool:
        """Whether a step planned ahead samples only once this feature has filled a mask (`after_step`)."""
        return False

    # ---- execute ---------------------------------------------------------------------------------------------
    def launched_ahead(self, plan: StepPlan) -> None:
        """`plan` was queued behind the step in flight."""

    # ---- commit ----------------------------------------------------------------------------------------------
    def consume(self, plan: StepPlan, result: StepResult,
                runs: list[tuple[Sequence, list[int], list]]) -> list[tuple[Sequence, list[int], list]]:
        """The step ran: `runs` is each sampled sequence's (seq, tokens, logprobs); returns what to append."""
        return runs

    def owns_commit(self, plan: StepPlan, seq: Sequence) -> bool:
        """Whether this feature commits seq's computed tokens itself (in `after_append`)."""
        return False

    def after_computed(self, plan: StepPlan) -> None:
        """The scheduled sequences' computed tokens are committed; no token is appended yet."""

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why appending `token` ends seq (None: it does not), checked after stop tokens, before the length."""
        return None

    def after_append(self, plan: StepPlan, seq: Sequence, tokens: list[int], record: EngineOutput) -> None:
        """seq's tokens of this step are appended (it may have finished)."""

    def finish_step(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Every token is appended: records for requests that got no token (a prompt chunk's logprobs)."""
        return []

    def after_step(self, queued: InFlight | None) -> None:
        """The step is committed; `queued` is the step planned ahead of it (in flight), if any."""

    # ---- state -----------------------------------------------------------------------------------------------
    def adopt(self, seq: Sequence, tokens: list[int]) -> None:
        """seq joins with `tokens` already sampled elsewhere (a disaggregated prefill instance's first token): bring
        its state past them."""

    def release(self, seq: Sequence) -> None:
        """seq lost its blocks (finished or preempted): drop what is kept for it."""

    def stats(self) -> dict:
        return {}
