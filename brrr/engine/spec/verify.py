"""The engine's side of speculative decoding: which sequences speculate, their drafts, the acceptance of a verified
run, the hidden states an EAGLE proposer reads, and the counters vLLM reports (docs/speculative.md).

Acceptance. The target samples every verified position i with the ordinary sampler, keyed like any token of the
sequence (seed, output index), giving y_0..y_d; the run keeps the drafts while draft_i == y_i and then y_a (the
target's token at the first mismatch, or the bonus token after all d). Every proposer here is deterministic (its
q is one-hot on x), for which the rejection rule is: accept x with probability min(1, p(x)/q(x)) = p(x), else draw
from norm(max(0, p - q)) = p without x. Drawing y ~ p with the sampler's Gumbel noise and accepting iff y == x is
exactly that rule (P(y = x) = p(x); y given y != x is p without x, renormalized), so the output has the target's
distribution, and a seeded request gives the very tokens it gives without speculation. Greedy is the case T = 0.
"""
from __future__ import annotations

import numpy as np
import torch

from brrr.config.speculative import SpeculativeConfig
from brrr.engine.sequence import Sequence
from brrr.engine.spec.proposer import Proposer, SpecInput
from brrr.sampling_params import SamplingParams


class DeviceDrafts:
    """A proposal's drafts left on the device: tokens [rows, k] and each input's row (None: no drafts). The verify
    step gathers its draft ids from them on the device (`device_draft_gather`), so the host queues it without
    waiting for the proposal. Their host copy is queued now, on the compute stream (ordered before any later write
    to a proposer's static buffer), and read after the verify step's tokens, by when it has long arrived."""

    def __init__(self, tokens: torch.Tensor, rows: list[int | None]):
        self.tokens, self.rows = tokens, rows
        self._ready = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens.clone()
        self._lists: list[list[int]] | None = None

    def host(self) -> list[list[int]]:
        """Every row's drafts on the host (waits for the copy the first time)."""
        if self._lists is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._lists = self._host.tolist()
        return self._lists

    def lists(self) -> list[list[int]]:
        """Per input, its drafts (`Proposer.propose`'s result)."""
        host = self.host()
        return [[] if r is None else host[r] for r in self.rows]


def device_draft_gather(batch) -> tuple[torch.Tensor, np.ndarray, np.ndarray] | None:
    """For a step whose drafts are still on the device: (their tokens [rows, k], each draft's index into them
    flattened, its index among the step's flattened token ids); None when the step has none."""
    source, src, dst, at = None, [], [], 0
    for seq, n in batch.items:
        real = min(n, len(seq.token_ids) - seq.num_computed_tokens)  # the rest of the row are drafts
        if seq.spec_device is not None and real < n:
            drafts, row = seq.spec_device
            if source is not None and drafts.tokens is not source:
                raise RuntimeError("a step verifies drafts of two proposals")  # one proposal per step
            source, k = drafts.tokens, drafts.tokens.shape[1]
            src.extend(range(row * k, row * k + n - real))
            dst.extend(range(at + real, at + n))
        at += n
    return None if source is None else (source, np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))


def write_device_drafts(ids: torch.Tensor, tokens: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """ids[dst] = the drafts at flat indices src of tokens [rows, k] (`device_draft_gather`'s indices, staged)."""
    ids.index_copy_(0, dst, tokens.reshape(-1).index_select(0, src))


def _needs_draft_values(seq: Sequence) -> bool:
    """Whether the host reads a sequence's drafts before its verify step samples: a grammar cuts them, penalties
    and min_tokens score position i with the drafts before it in the history."""
    params = seq.request.params
    return (seq.guide is not None or params.structured_outputs is not None or params.has_penalties
            or bool(params.min_tokens))


def speculatable(params: SamplingParams, needs_hidden: bool = False) -> bool:
    """Requests whose every verified position the sampler can score before the drafts are known to be kept.
    Logprobs, penalties and min_tokens are: position i is scored as if the drafts before it were kept (its history
    includes them), which is the only case in which its token is used. Not speculated (they decode normally in the
    same batch): n > 1 for a proposer that reads hidden states (the samples fork from one prompt, whose hidden
    states it reads once). A grammar's drafts are cut to what it allows, and position i is masked from a copy of
    the matcher moved past the drafts before it."""
    return params.n == 1 or not needs_hidden


# A proposer that keeps finding nothing (the output does not repeat its context) must not cost the engine its
# launch-ahead decoding, which a step that may verify drafts gives up: after IDLE_ROUNDS proposal rounds in a row
# with no draft, steps pipeline again and proposals are tried once every PROBE_EVERY steps. Proposers that read
# the target's hidden states (EAGLE) need every step's, which a pipelined step does not keep: they never idle.
IDLE_ROUNDS = 2
PROBE_EVERY = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, device_drafts: bool = True):
        """device_drafts: whether the engine's runner gathers drafts left on the device (`device_draft_gather`; a
        tensor-parallel one sends its workers host ids)."""
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.device_drafts = device_drafts and proposer.device_drafts
        self._empty_rounds = 0  # proposal rounds in a row that found no draft
        self._since_probe = 0  # steps launched ahead since the last proposal round
        # hidden states the target computed and kept since each sequence's last propose (EAGLE): seq_id -> rows
        self._hidden: dict[int, list[torch.Tensor]] = {}
        # vLLM's counters (spec_decode_*): verified runs with at least one draft, drafts, accepted drafts, and
        # accepted drafts by position in the run
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_verify_steps = 0  # engine steps that verified at least one draft (not a vLLM counter)
        self.accepted_per_pos = [0] * self.k

    @property
    def needs_hidden(self) -> bool:
        return self.proposer.needs_hidden

    def speculates(self, seq: Sequence) -> bool:
        return speculatable(seq.request.params, self.needs_hidden)

    def enabled(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, running: list[Sequence], room) -> None:
        """Set spec_tokens on every running decode that speculates this step. room(seq): the most draft tokens its
        max_tokens and the context still allow (a run emits drafts + 1 tokens)."""
        for seq in running:
            seq.drop_drafts()
        if not self.enabled(len(running)):
            return
        seqs, limits = [], []
        for seq in running:
            if seq.num_uncomputed != 1 or not self.speculates(seq):
                continue
            limit = min(self.k, room(seq))
            if limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return
        inputs = [SpecInput(seq.seq_id, seq.token_ids, self._take_hidden(seq.seq_id)) for seq in seqs]
        if self.device_drafts and not any(map(_needs_draft_values, seqs)):
            drafts = self.proposer.propose_on_device(inputs, self.k)
            for seq, limit, row in zip(seqs, limits, drafts.rows):
                if row is not None:  # placeholders until `resolve`
                    seq.spec_tokens, seq.spec_device = [0] * min(limit, drafts.tokens.shape[1]), (drafts, row)
        else:
            for seq, limit, draft in zip(seqs, limits, self.proposer.propose(inputs, self.k)):
                draft = list(draft[:limit])
                if seq.guide is not None:  # a draft the grammar forbids would be rejected anyway: not worth a slot
                    draft = draft[:seq.guide.valid_prefix(draft)]
                seq.spec_tokens = draft
        self._empty_rounds = 0 if any(seq.spec_tokens for seq in seqs) else self._empty_rounds + 1
        self._since_probe = 0

    def idle(self) -> bool:
        """The last proposal rounds found nothing and the next is not due: the engine may launch steps ahead."""
        return not self.needs_hidden and self._empty_rounds >= IDLE_ROUNDS and self._since_probe < PROBE_EVERY

    def launched_ahead(self) -> None:
        self._since_probe += 1

    @staticmethod
    def resolve(seqs) -> None:
        """The verify step's tokens are on the host: the drafts it verified from the device are read too (no wait
        by now), replacing their placeholders."""
        for seq in seqs:
            if seq.spec_device is not None:
                drafts, row = seq.spec_device
                seq.spec_tokens = drafts.host()[row][:len(seq.spec_tokens)]
                seq.spec_device = None

    def accept(self, drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens a verified run emits: the drafts up to the first that differs from the target's token there,
        then the target's token (len(targets) == len(drafts) + 1)."""
        a = 0
        while a < len(drafts) and drafts[a] == targets[a]:
            a += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += a
        for i in range(a):
            self.accepted_per_pos[i] += 1
        return targets[:a + 1]

    def keep_hidden(self, seq_id: int, rows: torch.Tensor) -> None:
        self._hidden.setdefault(seq_id, []).append(rows)

    def _take_hidden(self, seq_id: int) -> torch.Tensor | None:
        if not self.needs_hidden:
            return None
        rows = self._hidden.pop(seq_id, [])
        return torch.cat(rows) if len(rows) > 1 else (rows[0] if rows else None)

    def release(self, seq: Sequence) -> None:
        seq.drop_drafts()
        self._hidden.pop(seq.seq_id, None)
        self.proposer.release(seq.seq_id)

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_verify_steps": self.num_verify_steps}
