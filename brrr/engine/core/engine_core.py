"""`EngineCore`: requests in, one step at a time, one `EngineOutput` record per sample that progressed out (what the
engine process runs; `LLMEngine` adds the output processor). Single-threaded.

A step is plan -> execute -> commit over a `StepPlan` (core/plan.py). The features (speculation, structured-output
masks, prompt logprobs, n > 1 forks, LoRA rows) take part through the hooks of core/feature.py; the step names none
of them.

Steady decoding overlaps the host with the device: step t+1 is planned and queued, its input ids gathered on the
device from step t's sampled tokens, before the host waits for t's tokens, so the host's bookkeeping for t (and its
next scheduling) overlaps the device's work on t+1 instead of leaving the device idle between steps."""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import wait as wait_futures

import torch

from brrr.analysis.model import is_mla
from brrr.config import COMPACTING_EVICTIONS, EngineConfig
from brrr.engine.block_manager import BlockManager
from brrr.engine.core.feature import Feature, hooked
from brrr.engine.core.plan import InFlight, SampleSlot, StepPlan, StepResult
from brrr.engine.core.requests import check_request
from brrr.engine.eviction import eviction_policy
from brrr.engine.forks import Forks
from brrr.engine.guided.feature import Guided
from brrr.engine.lora_rows import AdapterRows
from brrr.engine.model_runner import ModelRunner, kv_bytes_per_block
from brrr.engine.outputs import EngineOutput
from brrr.engine.prompt_logprobs import PromptLogprobs
from brrr.engine.sampler import SampleRow, h2d
from brrr.sampling_params import SamplingParams
from brrr.engine.scheduler import ScheduledBatch, Scheduler
from brrr.engine.sequence import Request, Sequence
from brrr.engine.spec.feature import Speculation
from brrr.engine.spec.verify import Speculator
from brrr.engine.spec.verify_graphs import verify_graph_spec
from brrr.engine.swap import host_prefix_tier, swap_policy
from brrr.errors import BrrrError
from brrr.kernels.attention.kv_quant import cache_dtype
from brrr.kernels.quant import quant_tuning
from brrr.lora.serving import LoRARequest
from brrr.serving_form import prepare_for_serving

log = logging.getLogger("brrr.engine")
CPU_KV_DEFAULT = 256 << 20  # zeroing more costs seconds at start-up on small CPU machines


class StepFailed(Exception):
    """A phase of the step raised: the requests it concerned fail, the engine goes on."""

    def __init__(self, requests: set[Request], error: str):
        super().__init__(error)
        self.requests, self.error = requests, error


@contextlib.contextmanager
def failing(requests, what: str = "step failed"):
    """Turn an exception into StepFailed for `requests` (a callable: evaluated only on failure)."""
    try:
        yield
    except StepFailed:
        raise
    except Exception as e:  # one bad step must not take the engine down: fail its requests, keep serving
        reqs = requests()
        log.exception("%s; aborting the %d requests in it", what, len(reqs))
        raise StepFailed(reqs, f"{type(e).__name__}: {e}") from e


class EngineCore:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, eos_token_ids=()):
        """tokenizer: only to accept prompts given as text."""
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        self.eos_token_ids = tuple(eos_token_ids)
        cfg, ec = model.config, self.config
        if ec.disaggregate is not None:  # the prefill instances are started with the engine, not here
            raise BrrrError("disaggregate needs its prefill instances: LLM(model, disaggregate=...) or brrr serve "
                            "--disaggregate")
        self.max_model_len = min(ec.max_model_len or cfg.max_context, cfg.max_context)
        if ec.kv_eviction is not None and cfg.sliding_window is not None:  # its mask counts cache slots, not positions
            raise BrrrError(f"kv_eviction={ec.kv_eviction!r} does not combine with the model's sliding_window "
                            f"({cfg.sliding_window}) yet")
        if ec.kv_eviction in COMPACTING_EVICTIONS and is_mla(cfg):  # its latent cache has no per-head keys to score
            raise BrrrError(f"kv_eviction={ec.kv_eviction!r} does not combine with an MLA model's latent cache yet")
        adapters = (AdapterRows.build(model, ec, lambda: self.scheduler.running_adapters()) if ec.enable_lora
                    else None)
        self.lora = None if adapters is None else adapters.manager  # the adapters served (None: none)
        # before sizing the KV cache: packs layer by layer (and the LoRA slots are allocated already)
        self.model = model = prepare_for_serving(model, ec, None if adapters is None else adapters.slots)
        # a draft model or EAGLE head loads before the KV cache is sized: its weights are memory in use, its cache a
        # cost per block
        proposer = None
        if ec.speculative_config is not None:
            from brrr.engine.spec import make_proposer  # each method's dependencies load only when it is used

            proposer = make_proposer(ec.speculative_config, model)
        num_blocks = self._num_blocks(proposer.kv_bytes_per_block(ec.block_size) if proposer else 0)
        spec_cfg = ec.speculative_config
        if proposer is not None:  # its graphs' warm-ups tune a quantized target's LM head at the draft shapes
            with quant_tuning():
                proposer.allocate_cache(num_blocks, ec.block_size, ec.cuda_graphs,
                                        min(ec.max_num_seqs, spec_cfg.disable_by_batch_size or ec.max_num_seqs),
                                        ec.max_num_batched_tokens, spec_cfg.num_speculative_tokens, self.max_model_len)
        p = next(model.parameters())
        block_bytes = kv_bytes_per_block(cfg, ec.block_size, cache_dtype(ec.kv_cache_dtype, p.dtype))
        swap = swap_policy(ec, cfg, p.device, p.dtype, block_bytes, self.max_model_len)
        swap_blocks = 0 if swap is None else swap.pool.num_blocks
        host_tier = host_prefix_tier(ec, block_bytes, first=swap_blocks)  # host ids after the swap pool's
        self.block_manager = BlockManager(num_blocks, ec.block_size, ec.enable_prefix_caching, host_tier)
        eviction = eviction_policy(ec, self.block_manager, cfg.num_layers, p.device)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_batched_tokens, ec.max_num_seqs, self.max_model_len,
                                   ec.max_loras if ec.enable_lora else None, on_release=self._released,
                                   eviction=eviction, swap=swap)
        speculator = None if proposer is None else Speculator(ec.speculative_config, proposer,
                                                              device_drafts=ec.tensor_parallel_size == 1)
        with quant_tuning():  # the eager step before each graph capture tunes the quantized matmuls' decode shapes
            # a sharded model's runner (tensor_parallel_size > 1) runs every step on every rank (model.tp_group)
            verify = None if proposer is None else verify_graph_spec(
                spec_cfg.num_speculative_tokens + 1, proposer.needs_hidden, ec.max_num_seqs,
                ec.max_num_batched_tokens, spec_cfg.disable_by_batch_size)
            graphs = ec.cuda_graphs and (eviction is None or eviction.allows_graphs)
            self.runner = ModelRunner(model, ec.block_size, num_blocks, self.max_model_len, graphs,
                                      ec.max_num_seqs, None if adapters is None else adapters.row_input, verify,
                                      ec.kv_cache_dtype, ec.calculate_kv_scales,
                                      num_host_blocks=swap_blocks + (host_tier.num_blocks if host_tier else 0))
        if eviction is not None and eviction.observes:
            self.runner.attention_observer = eviction
        self.features: list[Feature] = self._features(speculator, adapters)
        self._set_on([f for f in self.features if not f.per_request])
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = self.num_steps = 0
        self._queued: InFlight | None = None  # a step planned ahead of the last one, in flight, tokens unread
        self.schedule_log: list | None = None  # a list: each executed step's (computed, new) per sequence (benches)

    def _features(self, speculator: Speculator | None, adapters: AdapterRows | None) -> list[Feature]:
        """Every feature this engine can run; per-request ones join a step only while a request uses them. The
        order is the order their hooks run in: speculation claims a verified run's slots before a fork could."""
        features: list[Feature] = []
        if speculator is not None:
            features.append(Speculation(speculator, self.scheduler, self.block_manager, self.max_model_len,
                                        self.runner))
        features += [Forks(self.scheduler), PromptLogprobs(),
                     Guided(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)]
        return features if adapters is None else features + [adapters]

    def feature(self, name: str) -> Feature | None:
        return next((f for f in self.features if f.name == name), None)

    @property
    def spec(self) -> Speculator | None:
        """Speculative decoding's state (proposer, counters), None without it."""
        feature = self.feature("spec")
        return None if feature is None else feature.spec

    @spec.setter
    def spec(self, speculator: Speculator) -> None:  # tests swap in a proposer of their own
        self.feature("spec").spec = speculator

    def _set_on(self, on: list[Feature]) -> None:
        self._on = on  # the features in the step now
        self._hooks = hooked(on)  # hook -> those of them that implement it

    def _activate(self, request: Request) -> None:
        """The per-request features this request uses join the step."""
        for f in self.features:
            if f.per_request and f not in self._on and f.wants(request):
                self._set_on([g for g in self.features if g in self._on or g is f])

    def _deactivate_unused(self) -> None:
        """Per-request features no live request uses leave the step (then they cost nothing)."""
        if any(f.per_request for f in self._on):
            live = self.requests.values()
            self._set_on([f for f in self._on if not f.per_request or any(map(f.wants, live))])

    def adopt(self, seq: Sequence, tokens: list[int]) -> None:
        """A sequence placed with tokens sampled elsewhere (Scheduler.add_prefilled): the features catch up."""
        for f in self._hooks["adopt"]:
            f.adopt(seq, tokens)

    def _released(self, seq: Sequence) -> None:
        if self.scheduler.eviction is not None:  # what the policy keeps for it goes with its blocks
            self.scheduler.eviction.release(seq)
        for f in self._hooks["release"]:
            f.release(seq)

    # ---- adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) --------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter now (requests naming it load it anyway); BrrrError says what is wrong."""
        if self.lora is None:
            raise BrrrError(f"LoRA adapter {lora_request.lora_name!r}: this engine serves no adapters; start it "
                            "with enable_lora=True (brrr serve --enable-lora)")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter. Running requests on it finish on it; queued ones load it again from their path."""
        return self.lora is not None and self.lora.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.lora.list_loras()) if self.lora else set()

    def _num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """extra_bytes_per_block: a draft model's cache, which holds as many tokens as the target's."""
        ec, model = self.config, self.model
        if ec.num_blocks:
            return ec.num_blocks
        p = next(model.parameters())
        per_block = kv_bytes_per_block(model.config, ec.block_size, cache_dtype(ec.kv_cache_dtype, p.dtype)
                                       ) + extra_bytes_per_block
        # Every sequence at full length: more blocks would only keep finished prompts cached, and a small model on
        # a big GPU would take the whole card for them (and starve other processes on it).
        useful = ec.max_num_seqs * -(-self.max_model_len // ec.block_size)
        if ec.kv_cache_memory:
            blocks = ec.kv_cache_memory // per_block
        elif p.device.type == "cuda":
            blocks = min(useful, ModelRunner.profile_num_blocks(model, ec.block_size, ec.max_num_batched_tokens,
                                                                ec.gpu_memory_utilization, extra_bytes_per_block,
                                                                ec.kv_cache_dtype))
        else:  # CPU: a fixed budget
            blocks = min(CPU_KV_DEFAULT // per_block, useful)
        if blocks < 1:
            raise BrrrError(f"no memory left for the KV cache (one block of {ec.block_size} tokens needs {per_block} "
                            "bytes); lower max_num_batched_tokens or raise gpu_memory_utilization/kv_cache_memory")
        return int(blocks)

    # ---- requests -------------------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and tokenize, without touching engine state (safe from another thread)."""
        bm = self.block_manager
        ev = self.scheduler.eviction  # an evicting sequence never holds more than its budget
        return check_request(request_id, prompt, params, self.tokenizer, self.model.config.vocab_size,
                             self.max_model_len, bm.block_size, bm.num_blocks, self.eos_token_ids, lora_request,
                             None if ev is None else ev.budget, ev is not None and ev.whole_prompt)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params, lora_request))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise BrrrError(f"request_id {request.request_id!r} is already in use")
        if request.params.n > 1 and self.config.kv_eviction in COMPACTING_EVICTIONS:
            raise BrrrError(f"SamplingParams.n must be 1 with kv_eviction={self.config.kv_eviction!r}, got "
                            f"{request.params.n}: eviction rewrites the prompt blocks the samples would share")
        if request.lora_request is not None:  # loaded (from its path) and checked before it can be scheduled
            self.add_lora(request.lora_request)
        self.requests[request.request_id] = request
        self._activate(request)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Stop a request now (or only its sample `index`, which a stop string ended) and free its KV blocks. False
        if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.finished and (index is None or seq.index == index):
                self.scheduler.finish(seq, "abort")
        if index is None or request.finished:
            del self.requests[request_id]
            request.finish_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self, batch: ScheduledBatch | None = None) -> list[EngineOutput]:
        """Run one step (the scheduler's next one unless a batch is given: then just that, nothing queued behind
        it) and commit its tokens. Returns one record per sample that got a token, finished, failed or got prompt
        logprobs."""
        if batch is not None and self._queued is not None:
            raise BrrrError("step(batch) while a pipelined step is in flight: call step() without a batch")
        try:
            inflight = self._take_queued() or self._execute(self._plan(batch), overlap=batch is None)
            if inflight is None:
                return []
            queued = self._queue_next(inflight) if batch is None else None  # step t+1 queued behind t
            result, runs = self._result(inflight)  # the host waits for step t's tokens here
        except StepFailed as failed:
            return self._fail(failed.requests, failed.error)
        records = self._commit(inflight.plan, result, runs)
        self._queued = queued
        for feature in self._hooks["after_step"]:
            feature.after_step(queued)
        return records

    # ---- plan -------------------------------------------------------------------------------------------------
    def _plan(self, batch: ScheduledBatch | None) -> StepPlan | None:
        if batch is None:
            self._deactivate_unused()
            running = self.scheduler.running
            with failing(lambda: {s.request for s in running}, "proposer failed"):
                for feature in self._hooks["propose"]:
                    feature.propose(running)
            batch = self.scheduler.schedule()
        self._queue_swaps(batch)  # before the step's own copies; also when it runs nothing
        if not batch.items:
            return None
        if self.schedule_log is not None:
            self.schedule_log.append([(seq.num_computed_tokens, n) for seq, n in batch.items])
        return self._make_plan(batch)

    def _queue_swaps(self, batch: ScheduledBatch) -> None:
        """The batch's host copies (swap preemption, the prefix cache's host tier), queued before its step."""
        if batch.swap_out or batch.swap_in:
            with failing(lambda: {seq.request for seq, _ in batch.items}, "swap copies failed"):
                self.runner.swap_blocks(batch.swap_out, batch.swap_in)

    def _make_plan(self, batch: ScheduledBatch, ids_from=None) -> StepPlan:
        """Each item samples its last row when this step reaches the end of its tokens (a step planned ahead: one
        token further than the host knows); the features add or change slots and rows."""
        plan, row, ahead = StepPlan(batch, ids_from=ids_from), 0, int(ids_from is not None)
        contributors, slots = self._hooks["contribute"], plan.slots
        if ahead and not contributors:  # steady decoding: one slot a sequence, nothing else to ask
            plan.slots = None
            plan.rows = [self._sample_row(seq, 1) for seq, _ in batch.items]
            return self._model_inputs(plan)
        for seq, n in batch.items:
            mine = [SampleSlot(row + n - 1, seq, ahead)] if ahead or seq.num_computed_tokens + n == len(
                seq.token_ids) else []
            for feature in contributors:
                mine = feature.contribute(plan, seq, n, row, mine)
            plan.multi_token = plan.multi_token or (len(mine) > 1 and mine[0].seq is mine[1].seq)
            slots += mine
            row += n
        plan.rows = [self._sample_row(seq, offset) for _, seq, offset in slots]
        return self._model_inputs(plan)

    def _model_inputs(self, plan: StepPlan) -> StepPlan:
        if self._hooks["model_inputs"]:  # (a feature may load state for it: an adapter that fails fails its step)
            with failing(lambda: {seq.request for seq in plan.sequences}):
                for feature in self._hooks["model_inputs"]:
                    feature.model_inputs(plan)
        return plan

    def _sample_row(self, seq: Sequence, offset: int) -> SampleRow:
        params = seq.request.params
        # The output so far is copied only for requests that read it (penalties, min_tokens): an O(length) slice
        # per sequence per step is host work the device would wait on.
        history = seq.output_ids if params.has_penalties or params.min_tokens else ()
        if offset and seq.spec_tokens and (params.has_penalties or params.min_tokens):
            history = history + seq.spec_tokens[:offset]  # verified position `offset`: after the drafts before it
        row = SampleRow(params, seq.seed, len(seq.token_ids) - len(seq.request.prompt_token_ids) + offset,
                        seq.request.prompt_token_ids, history, self._stop_ids(params))
        for feature in self._hooks["sample_row"]:
            row = feature.sample_row(seq, offset, row)
        return row

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _launchable(self, plan: StepPlan) -> bool:
        """Whether the step may run with its tokens left on the device: a decode step through a captured graph,
        one slot per row, none reading the host (logprobs), or the output so far, which would lag a step behind
        (penalties, min_tokens), and every feature in the step agreeing."""
        batch = plan.batch
        return (self.runner.can_launch(batch) and len(plan.slots) == len(batch.items)
                and all(slot.row == i and slot.offset == 0 for i, slot in enumerate(plan.slots))
                and all(r.params.logprobs is None and not r.params.has_penalties and not r.params.min_tokens
                        for r in plan.rows)
                and all(feature.allows_launch(plan) for feature in self._hooks["allows_launch"]))

    # ---- execute ----------------------------------------------------------------------------------------------
    def _execute(self, plan: StepPlan | None, overlap: bool) -> InFlight | None:
        """Hand the step to the runner: launched (its tokens stay on the device) when it may be, else run."""
        if plan is None:
            return None
        with failing(lambda: {seq.request for seq in plan.sequences}):
            if overlap and self._launchable(plan):
                return InFlight(plan, pending=self.runner.launch(plan.batch, plan.release_rows()))
            sampled, logits_logprobs, hidden = self.runner.execute(
                plan.batch, [(slot.row, row) for slot, row in zip(plan.slots, plan.rows)], plan.logit_rows,
                plan.want_hidden)
            return InFlight(plan, done=StepResult(sampled.tokens, sampled.logprobs, logits_logprobs, hidden))

    def _take_queued(self) -> InFlight | None:
        """The step queued behind the last one, if any of its sequences is still running; its sampling, when it
        waited for a feature's mask, is queued now."""
        inflight, self._queued = self._queued, None
        if inflight is None:
            return None
        if not inflight.live():
            if inflight.mask is not None:  # the mask thread is done with the matchers before they move again
                wait_futures([inflight.mask])
            return None
        if inflight.logits is not None:
            with failing(lambda: {seq.request for seq in inflight.plan.sequences}):
                mask = None if inflight.mask is None else inflight.mask.result()
                inflight.pending = self.runner.launch_sampling(inflight.logits, inflight.plan.rows, mask)
        return inflight

    def _queue_next(self, inflight: InFlight) -> InFlight | None:
        """Plan and queue step t+1 (the same sequences decoding) before step t's tokens reach the host, its input
        ids gathered on the device from t's; None when the scheduler or a feature needs t's tokens first."""
        if inflight.pending is None or not all(f.allows_ahead(inflight.plan) for f in self._hooks["allows_ahead"]):
            return None
        with failing(lambda: {seq.request for seq in inflight.plan.sequences}):
            nxt = self.scheduler.schedule_next_decode(inflight.plan.batch)
            if nxt is None:
                return None
            self._queue_swaps(nxt)  # a block it took may be a cached one the host tier keeps: copied out first
            if self.schedule_log is not None:
                self.schedule_log.append([(seq.num_computed_tokens + 1, 1) for seq, _ in nxt.items])
            tokens = inflight.pending.device_tokens
            plan = self._make_plan(nxt, (tokens, h2d(nxt.previous_rows, tokens.device, torch.long)))
            for feature in self._hooks["launched_ahead"]:
                feature.launched_ahead(plan)
            if any(feature.defers_sampling(plan) for feature in self._hooks["defers_sampling"]):
                # only the sampling waits: the forward runs while the host reads step t and a feature fills the mask
                return InFlight(plan, logits=self.runner.launch_forward(nxt, plan.ids_from))
            return InFlight(plan, pending=self.runner.launch(nxt, plan.release_rows(), plan.ids_from))

    def _result(self, inflight: InFlight) -> tuple[StepResult, list[tuple[Sequence, list[int], list]]]:
        """The step's tokens on the host, grouped by sequence, as the features leave them."""
        plan = inflight.plan
        with failing(lambda: {seq.request for seq in plan.sequences}):
            result = inflight.done
            if result is None:
                tokens = inflight.pending.tokens()
                result = StepResult(tokens, [None] * len(tokens))
            if not plan.multi_token:  # one token a sequence
                runs = [(seq, [token], logprobs if logprobs is None else [logprobs])
                        for (_, seq, _), token, logprobs in zip(plan.each_slot(), result.tokens, result.logprobs)]
            else:  # a sequence's consecutive slots are one run (a verified run's positions)
                runs, last = [], None
                for (_, seq, _), token, logprobs in zip(plan.slots, result.tokens, result.logprobs):
                    if seq is last:
                        runs[-1][1].append(token)
                        runs[-1][2].append(logprobs)
                    else:
                        runs.append((seq, [token], [logprobs]))
                        last = seq
            for feature in self._hooks["consume"]:
                runs = feature.consume(plan, result, runs)
            return result, runs

    # ---- commit -----------------------------------------------------------------------------------------------
    def _commit(self, plan: StepPlan, result: StepResult, runs) -> list[EngineOutput]:
        self.num_steps += 1
        hooks, commit_computed = self._hooks, self.block_manager.commit_computed
        owners = hooks["owns_commit"]
        for seq, n in plan.batch.items:  # a sequence a stop or an abort ended while the step was in flight: skip
            if seq.finished or (owners and any(f.owns_commit(plan, seq) for f in owners)):
                continue
            prompt = len(seq.request.prompt_token_ids)
            if seq.num_computed_tokens < prompt:
                self.prompt_tokens_total += min(n, prompt - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            commit_computed(seq, seq.request.cache_key)
        if self.scheduler.eviction is not None:  # what the step's observer evicted (snapkv, h2o), on the host
            self.scheduler.eviction.after_step(plan.batch)
        for feature in hooks["after_computed"]:
            feature.after_computed(plan)
        now, records, appended = time.monotonic(), [], hooks["after_append"]
        for seq, tokens, logprobs in runs:
            if seq.finished:
                continue
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            record = self._append(seq, tokens, logprobs)
            for feature in appended:
                feature.after_append(plan, seq, tokens, record)
            records.append(record)
        for feature in hooks["finish_step"]:
            for record in feature.finish_step(plan, result):
                request = self.requests.get(record.request_id)
                records.append(record if request is None else self._reported(request, record))
        return records

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list) -> EngineOutput:
        """Append a run's tokens one at a time: a stop token, a feature (a complete grammar), max_tokens or the
        context ends the sequence there."""
        req, params = seq.request, seq.request.params
        appended, reason, finishers = 0, None, self._hooks["finish_reason"]
        for token in tokens:
            seq.token_ids.append(token)
            appended += 1
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                reason = "stop"
            else:
                for feature in finishers:
                    reason = feature.finish_reason(seq, token)
                    if reason is not None:
                        break
                if reason is None and self.scheduler.at_length(seq):
                    reason = "length"
            if reason:
                break
        self.generation_tokens_total += appended
        if appended < len(tokens):
            tokens = tokens[:appended]
        if logprobs is not None and (logprobs[0] is None or len(logprobs) > appended):
            # None: nobody asked; a verified run has one per position, and may have kept fewer
            logprobs = None if logprobs[0] is None else logprobs[:appended]
        record = EngineOutput(req.request_id, seq.index, tokens, logprobs, reason)
        self._reported(req, record)
        if reason:
            self.scheduler.finish(seq, reason)
            if req.finished:
                req.finish_time = time.monotonic()
                self.requests.pop(req.request_id, None)
        return record

    def _reported(self, req: Request, record: EngineOutput) -> EngineOutput:
        if not req.reported:  # the request's first record carries its scheduling facts
            req.reported = True
            record.first_scheduled_time, record.num_cached_tokens = req.first_scheduled_time, req.num_cached_tokens
        return record

    def _fail(self, requests, error: str) -> list[EngineOutput]:
        records = []
        for req in requests:
            EngineCore.abort(self, req.request_id)  # the core's own: a router in front must still see the error
            records.append(self._reported(req, EngineOutput(req.request_id, finish_reason="abort", error=error)))
        return records

    def stats(self) -> dict:
        bm = self.block_manager
        stats = {"num_requests_running": len(self.scheduler.running),
                 "num_requests_waiting": len(self.scheduler.waiting), "kv_cache_usage": bm.usage,
                 "num_blocks": bm.num_blocks, "prefix_cache_queries": bm.prefix_queries,
                 "prefix_cache_hits": bm.prefix_hits, "host_prefix_cache_hits": bm.host_hits,
                 "num_preemptions": self.scheduler.num_preemptions,
                 "prompt_tokens": self.prompt_tokens_total, "generation_tokens": self.generation_tokens_total,
                 "num_steps": self.num_steps}
        for feature in self.features:
            stats.update(feature.stats())
        return stats
