"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt position's log-probability under the model and its top-k,
read from the rows of the prefill chunks that compute it. A plug-in feature of the engine step (core/feature.py)."""
from __future__ import annotations

from brrr.engine.core.feature import Feature
from brrr.engine.core.plan import StepPlan, StepResult
from brrr.engine.outputs import EngineOutput
from brrr.engine.sampler import logprob_entries
from brrr.engine.sequence import Request, Sequence


def prompt_logprob_rows(seq: Sequence, n: int, row: int) -> tuple[Sequence, int, int, int] | None:
    """(seq, first row, count, first position predicted): the rows of this chunk predicting prompt positions not yet
    reported. Row i of the chunk predicts position start + i + 1; a sequence recomputing its prompt (preempted)
    reports nothing twice."""
    req = seq.request
    if req.params.prompt_logprobs is None or seq.index != 0:
        return None
    start = seq.num_computed_tokens
    first = max(req.num_prompt_logprobs, start + 1, 1)  # position 0 has no predecessor
    last = min(start + n, req.num_prompt_tokens - 1)
    if last < first:
        return None
    return seq, row + first - start - 1, last - first + 1, first


class PromptLogprobs(Feature):
    name = "prompt_logprobs"
    per_request = True

    def wants(self, request: Request) -> bool:
        return request.params.prompt_logprobs is not None

    def contribute(self, plan, seq, n, row, slots):
        wanted = prompt_logprob_rows(seq, n, row)
        if wanted is not None:
            plan.extras.setdefault(self.name, {"rows": [], "offset": len(plan.logit_rows)})["rows"].append(wanted)
            _, first, count, _ = wanted
            plan.logit_rows.extend(range(first, first + count))
        return slots

    def allows_launch(self, plan: StepPlan) -> bool:
        return self.name not in plan.extras

    def consume(self, plan, result, runs):
        """Each request's new entries ({token: logprob} of the prompt token and the top-k), read back in one
        transfer for the whole step."""
        mine = plan.extras.get(self.name)
        if mine is None:
            return runs
        targets, ks = [], []
        for seq, _, count, pos in mine["rows"]:
            targets += seq.request.prompt_token_ids[pos:pos + count]
            ks += [seq.request.params.prompt_logprobs] * count
        start = mine["offset"]
        read = logprob_entries(result.logits_logprobs[start:start + len(targets)], targets, ks)
        entries, offset = {}, 0
        for seq, _, count, pos in mine["rows"]:
            req = seq.request
            new = [None] if req.num_prompt_logprobs == 0 else []  # the first prompt token has no predecessor
            entries[req.request_id] = new + read[offset:offset + count]
            req.num_prompt_logprobs = pos + count
            offset += count
        mine["entries"] = entries
        return runs

    def after_append(self, plan, seq, tokens, record) -> None:
        mine = plan.extras.get(self.name)
        if mine is not None and seq.index == 0:
            record.new_prompt_logprobs = mine["entries"].pop(seq.request.request_id, None)

    def finish_step(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Prompt chunks that sample nothing yet still report their entries."""
        mine = plan.extras.get(self.name)
        if mine is None:
            return []
        return [EngineOutput(request_id, new_prompt_logprobs=entries) for request_id, entries in mine["entries"].items()]
