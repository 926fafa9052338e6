"""Requests and their sequences (one per parallel sample), with the per-sequence state the engine tracks."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from brrr.engine.guided import GuidedMatcher
from brrr.lora.serving import LoRARequest
from brrr.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output
    seed: int | None = None  # the request's seed + index: with the output length, the key of the sampler's noise
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the leading full, computed blocks
    # KV eviction (engine/eviction.py): logical blocks dropped between the sink blocks and the window; logical block
    # j >= sink + num_evicted_blocks is block_table[j - num_evicted_blocks]
    num_evicted_blocks: int = 0
    # swap preemption (engine/swap.py): the host blocks holding its computed K/V while it waits, in table order
    host_table: list[int] = field(default_factory=list)
    # SnapKV (engine/snapkv.py): prompt tokens a compaction dropped (per KV head; every head keeps as many), so
    # position p past the prompt is cache row p - num_dropped_tokens
    num_dropped_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | grammar | length | abort (EngineOutput says what each means)
    # where the output stands in the request's grammar (structured_outputs): advanced once per appended token, so
    # a preempted sequence's recomputed prefill, which appends nothing it had, leaves it where it was
    guide: GuidedMatcher | None = None
    # speculative decoding: the draft tokens proposed for this step, verified after token_ids[-1] (never committed
    # to token_ids: the step keeps the accepted prefix)
    spec_tokens: list[int] = field(default_factory=list)
    # (a proposal's drafts still on the device: a spec.verify.DeviceDrafts, this sequence's row there): spec_tokens
    # then holds placeholders of the right count, the verify step gathers the ids on the device, and
    # `Speculator.resolve` reads the values once the step's tokens are on the host
    spec_device: tuple[object, int] | None = None

    def drop_drafts(self) -> None:
        self.spec_tokens, self.spec_device = [], None

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs the engine has emitted
    reported: bool = False  # whether a record has carried the request's scheduling facts yet
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @property
    def cache_key(self) -> int | None:
        """The prefix cache's extra key: blocks computed with one adapter are never another's (or the base's)."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)
