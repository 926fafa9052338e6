"""The engine. `EngineCore`: requests in, one scheduled step at a time, one `EngineOutput` record per sample that
progressed out (what the engine process runs). `LLMEngine`: the core with the output processor in the same process,
whose steps give `RequestOutput`s (what `LLM`, the CLI and tests drive). Single-threaded."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace

import torch

from brrr.config import EngineConfig
from brrr.engine.block_manager import BlockManager
from brrr.engine.guided import compiler_for, fill_bitmask
from brrr.engine.model_runner import ModelRunner, kv_bytes_per_block
from brrr.engine.output_processor import OutputProcessor
from brrr.engine.outputs import EngineOutput, RequestOutput
from brrr.engine.sampler import PendingTokens, SampleRow, h2d, logprob_entries
from brrr.engine.scheduler import ScheduledBatch, Scheduler
from brrr.engine.sequence import Request, Sequence
from brrr.engine.spec.verify import Speculator
from brrr.engine.spec_graphs import graph_replays, verify_graph_spec
from brrr.errors import BrrrError
from brrr.kernels.quant import quant_tuning
from brrr.lora.serving import LoraManager, LoRARequest, projection_shapes
from brrr.lora.serving_slots import LoraSlots
from brrr.sampling_params import SamplingParams
from brrr.serving_form import prepare_for_serving

log = logging.getLogger("brrr.engine")
CPU_KV_DEFAULT = 256 << 20  # zeroing more costs seconds at start-up on small CPU machines


def check_request(request_id: str, prompt: str | list[int], params: SamplingParams | None, tokenizer,
                  vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                  eos_token_ids: tuple[int, ...] | None = None, lora_request: LoRARequest | None = None) -> Request:
    """A validated, tokenized Request for an engine of these limits, or a BrrrError naming what is wrong. Shared by
    `EngineCore.make_request` and the server process, which checks requests before they reach the engine process.
    A structured_outputs constraint is compiled here (cached per tokenizer), so a bad one fails the request now;
    eos_token_ids: the engine's (the tokenizer's EOS when not given), which the grammar lets through. lora_request:
    the adapter the request runs with (the engine loads and checks it when the request is queued)."""
    params = params or SamplingParams()
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise BrrrError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    if not isinstance(params, SamplingParams):
        raise BrrrError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BrrrError("this engine has no tokenizer: pass the prompt as token ids")
        ids, text = tokenizer.encode(prompt), prompt
    elif isinstance(prompt, list) and set(map(type, prompt)) <= {int}:  # C loops: a server checks every request
        ids, text = list(prompt), None
    else:
        raise BrrrError("prompt must be a string or a list of token ids")
    if not ids:
        raise BrrrError("prompt is empty: it must have at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BrrrError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) + params.max_tokens > max_model_len:
        raise BrrrError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                        f"{len(ids) + params.max_tokens} exceeds the model's context of {max_model_len} tokens")
    need = -(-(len(ids) + params.max_tokens) // block_size)
    if need > num_blocks:
        raise BrrrError(f"prompt + max_tokens needs {need} KV blocks; the cache has {num_blocks}")
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BrrrError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None:
        grammars(tokenizer, vocab_size, eos_token_ids).compile(params.structured_outputs)
    return Request(request_id, text, ids, params, lora_request=lora_request)


@dataclass
class GuidedStep:
    """A guided decode step launched ahead: its forward is queued; its sampling waits for the masks, which the mask
    thread fills once the previous step's tokens have advanced the matchers."""
    logits: torch.Tensor
    rows: list[SampleRow]
    masks: Future | None = None

    def bitmask(self) -> torch.Tensor | None:
        return None if self.masks is None else self.masks.result()

    def wait(self) -> None:
        if self.masks is not None:
            wait_futures([self.masks])


_MASK_THREAD: ThreadPoolExecutor | None = None


def _mask_thread() -> ThreadPoolExecutor:
    global _MASK_THREAD
    if _MASK_THREAD is None:
        _MASK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="brrr-masks")
    return _MASK_THREAD


def grammars(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None):
    """The grammar compiler over this tokenizer and vocabulary (brrr/engine/guided/)."""
    if tokenizer is None:
        raise BrrrError("structured_outputs: this engine has no tokenizer, and a grammar is compiled against the "
                        "vocabulary")
    if eos_token_ids is None:
        eos_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return compiler_for(tokenizer, vocab_size, eos_token_ids)


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
        self.lora = self._lora_manager(model) if ec.enable_lora else None
        # before sizing the KV cache: packs layer by layer (and the LoRA slots are allocated already)
        self.model = model = prepare_for_serving(model, ec, self.lora.slots if self.lora else None)
        # a draft model or EAGLE head loads before the KV cache is sized: its weights are memory in use, its cache a
        # cost per block
        proposer = None
        if ec.speculative_config is not None:
            from brrr.engine.spec import make_proposer

            proposer = make_proposer(ec.speculative_config, model)
        num_blocks = self._num_blocks(proposer.kv_bytes_per_block(ec.block_size) if proposer else 0)
        spec_cfg = ec.speculative_config
        if proposer is not None:  # its graphs' warm-ups tune a quantized target's LM head at the draft shapes
            with quant_tuning():
                proposer.allocate_cache(num_blocks, ec.block_size, ec.cuda_graphs,
                                        min(ec.max_num_seqs, spec_cfg.disable_by_batch_size or ec.max_num_seqs),
                                        ec.max_num_batched_tokens, spec_cfg.num_speculative_tokens, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, ec.block_size, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_batched_tokens, ec.max_num_seqs, self.max_model_len,
                                   ec.max_loras if ec.enable_lora else None, on_release=self._released)
        self.spec = None if proposer is None else Speculator(ec.speculative_config, proposer,
                                                             device_drafts=ec.tensor_parallel_size == 1)
        with quant_tuning():  # the eager step before each graph capture tunes the quantized matmuls' decode shapes
            if ec.tensor_parallel_size > 1:  # rank 0 of a sharded model: the workers run each step beside it
                # (verify steps run eagerly there: its workers replay decode graphs only)
                from brrr.distributed.tp_runner import TensorParallelRunner
                self.runner = TensorParallelRunner(model, ec.block_size, num_blocks, self.max_model_len,
                                                   ec.cuda_graphs, ec.max_num_seqs, self.lora)
            else:
                verify = None if proposer is None else verify_graph_spec(
                    spec_cfg.num_speculative_tokens + 1, proposer.needs_hidden, ec.max_num_seqs,
                    ec.max_num_batched_tokens, spec_cfg.disable_by_batch_size)
                self.runner = ModelRunner(model, ec.block_size, num_blocks, self.max_model_len, ec.cuda_graphs,
                                          ec.max_num_seqs, self.lora, verify)
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = self.num_steps = 0
        # a decode step launched, tokens unread: its PendingTokens, or a GuidedStep until a guided step samples
        self._ahead: tuple[ScheduledBatch, PendingTokens | GuidedStep] | None = None
        self.schedule_log: list | None = None  # a list: each executed step's (computed, new) per sequence (benches)

    def _released(self, seq: Sequence) -> None:
        if self.spec is not None:
            self.spec.release(seq)

    def _speculating(self) -> bool:
        """Whether the next step may verify drafts: then no decode step is launched ahead of it (the drafts follow
        tokens the host has not read yet). Not while the proposer is idle (`Speculator.idle`)."""
        running = self.scheduler.running
        return (self.spec is not None and self.spec.enabled(len(running)) and not self.spec.idle()
                and any(self.spec.speculates(seq) for seq in running))

    def _draft_room(self, seq: Sequence) -> int:
        """The most drafts seq may verify: a run emits drafts + 1 tokens, within max_tokens and the context."""
        left = seq.request.params.max_tokens - seq.num_output_tokens - 1
        return min(left, self.max_model_len - len(seq.token_ids))

    def _lora_manager(self, model) -> LoraManager:
        ec, p = self.config, next(model.parameters())
        max_rows = max(ec.max_num_batched_tokens, ec.max_num_seqs)
        slots = LoraSlots(ec.max_loras, ec.max_lora_rank, max_rows, p.device, p.dtype)
        return LoraManager(slots, projection_shapes(model.config), ec.max_lora_rank,
                           ec.max_cpu_loras or ec.max_loras, lambda: self.scheduler.running_adapters())

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
        per_block = kv_bytes_per_block(model.config, ec.block_size, p.dtype) + extra_bytes_per_block
        # Every sequence at full length: more blocks would only keep finished prompts cached, and a small model on
        # a big GPU would take the whole card for them (and starve other processes on it).
        useful = ec.max_num_seqs * -(-self.max_model_len // ec.block_size)
        if ec.kv_cache_memory:
            blocks = ec.kv_cache_memory // per_block
        elif p.device.type == "cuda":
            blocks = min(useful, ModelRunner.profile_num_blocks(model, ec.block_size, ec.max_num_batched_tokens,
                                                                ec.gpu_memory_utilization, extra_bytes_per_block))
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
        return check_request(request_id, prompt, params, self.tokenizer, self.model.config.vocab_size,
                             self.max_model_len, bm.block_size, bm.num_blocks, self.eos_token_ids, lora_request)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params, lora_request))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise BrrrError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None:  # loaded (from its path) and checked before it can be scheduled
            self.add_lora(request.lora_request)
        self.requests[request.request_id] = request
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
        """Run one scheduled step (the scheduler's next one unless given) and apply its tokens. Returns one record
        per sample that got a token, finished, failed or got prompt logprobs.

        Steady decoding is pipelined: step t+1 is queued on the GPU, its input ids gathered there from step t's
        sampled tokens, before the host waits for t's tokens, so the host's bookkeeping for t (and its next
        scheduling) overlaps the GPU's work on t+1 instead of leaving the GPU idle between steps."""
        if self._ahead is not None:
            if batch is not None:
                raise BrrrError("step(batch) while a pipelined step is in flight: call step() without a batch")
            ahead, self._ahead = self._ahead, None
            if any(not seq.finished for seq, _ in ahead[0].items):
                return self._finish_decode(*ahead)
            if isinstance(ahead[1], GuidedStep):
                ahead[1].wait()  # its matchers are not touched again before the mask thread is done with them
        explicit = batch is not None  # a caller's own batch: run just that, nothing queued behind it
        if not explicit and self.spec is not None:
            try:
                self.spec.propose(self.scheduler.running, self._draft_room)
            except Exception as e:  # a failing proposer fails the requests it was proposing for, not the engine
                log.exception("proposer failed")
                return self._fail({s.request for s in self.scheduler.running}, f"{type(e).__name__}: {e}")
        batch = batch if batch is not None else self.scheduler.schedule()
        if not batch.items:
            return []
        if self.schedule_log is not None:
            self.schedule_log.append([(seq.num_computed_tokens, n) for seq, n in batch.items])
        if not explicit and self._pipelinable(batch):
            try:
                pending = self.runner.launch(batch, [self._sample_row(seq) for seq, _ in batch.items])
            except Exception as e:
                log.exception("step failed; aborting the %d requests in it", len(batch.items))
                return self._fail({s.request for s, _ in batch.items}, f"{type(e).__name__}: {e}")
            return self._finish_decode(batch, pending)
        sample_plan, prompt_rows, forks, row = [], [], [], 0
        for seq, n in batch.items:
            drafts = len(seq.spec_tokens)
            if drafts:  # a verified run: every position is sampled, each keyed by its own output index
                sample_plan += [(row + i, seq, i) for i in range(drafts + 1)]
            elif seq.num_computed_tokens + n == len(seq.token_ids):  # this chunk reaches the end: sample
                sample_plan.append((row + n - 1, seq, 0))
                if seq.request.params.n > 1 and len(seq.request.seqs) == 1:  # the prompt completes: fork
                    children = self.scheduler.make_forks(seq)
                    forks.append((seq, children))
                    sample_plan += [(row + n - 1, child, 0) for child in children]
            wanted = self._prompt_logprob_rows(seq, n, row)
            if wanted is not None:
                prompt_rows.append(wanted)
            row += n
        logit_rows = [r for _, first, count, _ in prompt_rows for r in range(first, first + count)]
        rows = [(r, self._sample_row(s, ahead=i)) for r, s, i in sample_plan]
        want_hidden = self.spec is not None and self.spec.needs_hidden
        try:
            result, prompt_lp, hidden = self.runner.execute(batch, rows, logit_rows, want_hidden)
            prompt_entries = self._prompt_logprobs(prompt_rows, prompt_lp) if prompt_rows else {}
        except Exception as e:  # one bad step must not take the engine down: fail its requests, keep serving
            log.exception("step failed; aborting the %d requests in it", len(batch.items))
            return self._fail({s.request for s, _ in batch.items}, f"{type(e).__name__}: {e}")
        self.num_steps += 1
        if self.spec is not None:  # drafts the step read on the device: their values, with its tokens
            self.spec.resolve(seq for seq, _ in batch.items)
        groups, at = [], 0  # (seq, its tokens, their logprobs): a verified run keeps its accepted prefix
        for _, seq, i in sample_plan:
            if i == 0:
                groups.append((seq, result.tokens[at:at + 1], result.logprobs[at:at + 1]))
            else:
                groups[-1][1].append(result.tokens[at])
                groups[-1][2].append(result.logprobs[at])
            at += 1
        # a run's logprobs are those of the tokens the target drew at each position: the emitted ones
        groups = [(seq, self.spec.accept(seq.spec_tokens, tokens), lps) if seq.spec_tokens else (seq, tokens, lps)
                  for seq, tokens, lps in groups]
        runs = {seq.seq_id: len(tokens) for seq, tokens, _ in groups if seq.spec_tokens}
        if runs:
            self.spec.num_verify_steps += 1
        for seq, n in batch.items:
            if seq.seq_id in runs:  # committed after its tokens are appended (`_roll_back`)
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.commit_computed(seq, seq.request.cache_key)
        for parent, children in forks:
            self.scheduler.admit_forks(parent, children)
        now, records = time.monotonic(), []
        for seq, tokens, logprobs in groups:
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            if seq.spec_tokens:
                record = self._append_tokens(seq, tokens, logprobs)
                self._roll_back(seq, len(tokens))
            else:
                record = self._append_token(seq, tokens[0], logprobs[0])
            if seq.index == 0 and prompt_entries:
                record.new_prompt_logprobs = prompt_entries.pop(seq.request.request_id, None)
            records.append(record)
        if hidden is not None:
            self._keep_hidden(batch, runs, hidden)
        if self.spec is not None:  # drafts live one step (a decode the budget left out drops its own too)
            for seq in self.scheduler.running:
                seq.drop_drafts()
        for request_id, entries in prompt_entries.items():  # a prompt chunk that samples nothing yet
            records.append(self._reported(self.requests[request_id], EngineOutput(request_id,
                                                                                  new_prompt_logprobs=entries)))
        return records

    def _roll_back(self, seq: Sequence, kept: int) -> None:
        """After a verified run: its last committed token and the accepted drafts (`kept` positions) stay in the KV
        cache; the rejected drafts' slots are dropped, and their blocks freed when the run crossed a block
        boundary. A run a stop cut short has finished and freed everything already."""
        if seq.finished:
            return
        seq.num_computed_tokens += kept
        self.block_manager.truncate(seq, len(seq.token_ids))
        self.block_manager.commit_computed(seq, seq.request.cache_key)

    def _keep_hidden(self, batch: ScheduledBatch, runs: dict[int, int], hidden: torch.Tensor) -> None:
        """Each running sequence's hidden states for the positions this step computed and kept (EAGLE reads them
        at its next propose): a prefill chunk's every row, a decode's one, a verified run's accepted prefix."""
        start = 0
        for seq, n in batch.items:
            if not seq.finished and self.spec.speculates(seq):
                self.spec.keep_hidden(seq.seq_id, hidden[start:start + runs.get(seq.seq_id, n)])
            start += n

    def _pipelinable(self, batch: ScheduledBatch) -> bool:
        """Decode rows that need nothing from the host but their own state: no logprobs (read on the host), no
        penalties or min_tokens (they read the output so far, which would lag a step behind). A grammar's mask
        follows the previous token, which the host has not seen when the next step is launched: guided steps launch
        their forward ahead and their sampling after (`_launch_next`)."""
        if self.spec is not None and self.spec.needs_hidden and self._speculating():
            return False  # the proposer reads this step's hidden states, which a captured graph does not keep
        return self.runner.can_launch(batch) and all(
            seq.request.params.logprobs is None and not seq.request.params.has_penalties
            and not seq.request.params.min_tokens and seq.request.params.n == 1 for seq, _ in batch.items)

    def _launch_next(self, batch: ScheduledBatch, pending: PendingTokens) -> None:
        """Queue the step the scheduler plans after `batch` (if any) before `batch`'s tokens reach the host."""
        if self._speculating():  # the next step proposes from this step's tokens: it waits for them
            return
        nxt = self.scheduler.schedule_next_decode(batch)
        if nxt is None:
            return
        if self.schedule_log is not None:
            self.schedule_log.append([(seq.num_computed_tokens + 1, 1) for seq, _ in nxt.items])
        if self.spec is not None:
            self.spec.launched_ahead()
        sample_rows = [self._sample_row(seq, ahead=1) for seq, _ in nxt.items]
        ids_from = (pending.device_tokens, h2d(nxt.previous_rows, pending.device_tokens.device, torch.long))
        if any(row.guide is not None for row in sample_rows):
            # Only the sampling waits for the grammar: the forward runs on the GPU while the host reads this step's
            # tokens, advances the matchers and fills the masks (`_start_masks`); `_finish_decode` samples it.
            self._ahead = (nxt, GuidedStep(self.runner.launch_forward(nxt, ids_from), sample_rows))
        else:
            self._ahead = (nxt, self.runner.launch(nxt, sample_rows, ids_from))

    def _start_masks(self) -> None:
        """The step launched ahead is guided and its matchers have seen the previous token: fill its masks on the
        mask thread (llguidance works outside the GIL), overlapping the host's work until the next step() samples
        it. A sequence that has just finished samples unconstrained (its grammar may be complete or dead; the token
        is dropped either way)."""
        nxt, step = self._ahead
        step.rows = [replace(row, guide=None) if seq.finished and row.guide is not None else row
                     for (seq, _), row in zip(nxt.items, step.rows)]
        guides = [row.guide for row in step.rows if row.guide is not None]
        if guides:
            step.masks = _mask_thread().submit(fill_bitmask, guides, step.logits.shape[1], step.logits.is_cuda)

    def _finish_decode(self, batch: ScheduledBatch, pending: PendingTokens) -> list[EngineOutput]:
        """Apply a launched decode step: queue the next one first, then wait for this one's tokens."""
        try:
            if isinstance(pending, GuidedStep):
                pending = self.runner.launch_sampling(pending.logits, pending.rows, pending.bitmask())
            self._launch_next(batch, pending)
            tokens = pending.tokens()
        except Exception as e:
            log.exception("step failed; aborting the %d requests in it", len(batch.items))
            self._ahead = None
            return self._fail({s.request for s, _ in batch.items}, f"{type(e).__name__}: {e}")
        self.num_steps += 1
        now, records = time.monotonic(), []
        for (seq, _), token in zip(batch.items, tokens):
            if seq.finished:  # a stop token or an abort ended it while this step was in flight
                continue
            seq.num_computed_tokens += 1
            self.block_manager.commit_computed(seq, seq.request.cache_key)
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            records.append(self._append_token(seq, token, None))
        if self._ahead is not None and isinstance(self._ahead[1], GuidedStep):
            self._start_masks()
        return records

    def _sample_row(self, seq: Sequence, ahead: int = 0) -> SampleRow:
        params = seq.request.params
        # The output so far is copied only for requests that read it (penalties, min_tokens): an O(length) slice
        # per sequence per step is host work the GPU would wait on.
        history = seq.output_ids if params.has_penalties or params.min_tokens else []
        if ahead and seq.spec_tokens and (params.has_penalties or params.min_tokens):
            history = history + seq.spec_tokens[:ahead]  # verified position `ahead`: after the drafts before it
        if params.structured_outputs is not None and seq.guide is None:  # its first token: each sample its own
            seq.guide = grammars(self.tokenizer, self.model.config.vocab_size,
                                 self.eos_token_ids).matcher(params.structured_outputs)
        guide = seq.guide
        if ahead and seq.spec_tokens and guide is not None:  # a verified position: the grammar past the drafts
            guide = guide.advanced(seq.spec_tokens[:ahead])
        return SampleRow(params, seq.seed, seq.num_output_tokens + ahead,
                         seq.request.prompt_token_ids, history, self._stop_ids(params), guide)

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    # ---- prompt logprobs ------------------------------------------------------------------------------------
    @staticmethod
    def _prompt_logprob_rows(seq: Sequence, n: int, row: int) -> tuple[Sequence, int, int, int] | None:
        """(seq, first row, count, first position predicted): the rows of this chunk predicting prompt positions not yet reported. Row i of
        the chunk predicts position start + i + 1; a sequence recomputing its prompt (preempted) reports nothing
        twice."""
        req = seq.request
        if req.params.prompt_logprobs is None or seq.index != 0:
            return None
        start = seq.num_computed_tokens
        first = max(req.num_prompt_logprobs, start + 1, 1)  # position 0 has no predecessor
        last = min(start + n, req.num_prompt_tokens - 1)
        if last < first:
            return None
        return seq, row + first - start - 1, last - first + 1, first

    def _prompt_logprobs(self, prompt_rows, logprobs: torch.Tensor) -> dict[str, list]:
        """Each request's new prompt-logprob entries ({token: logprob} of the prompt token and the top-k), read
        back in one transfer for the whole step."""
        targets, ks = [], []
        for seq, _, count, pos in prompt_rows:
            targets += seq.request.prompt_token_ids[pos:pos + count]
            ks += [seq.request.params.prompt_logprobs] * count
        read = logprob_entries(logprobs, targets, ks)
        entries, offset = {}, 0
        for seq, _, count, pos in prompt_rows:
            req = seq.request
            new = [None] if req.num_prompt_logprobs == 0 else []  # the first prompt token has no predecessor
            entries[req.request_id] = new + read[offset:offset + count]
            req.num_prompt_logprobs = pos + count
            offset += count
        return entries

    # ---- results --------------------------------------------------------------------------------------------
    def _reported(self, req: Request, record: EngineOutput) -> EngineOutput:
        if not req.reported:  # the request's first record carries its scheduling facts
            req.reported = True
            record.first_scheduled_time, record.num_cached_tokens = req.first_scheduled_time, req.num_cached_tokens
        return record

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> EngineOutput:
        """A verified run's tokens, one at a time: a stop token, max_tokens or the context cuts the run there."""
        record = None
        for token, entry in zip(tokens, logprobs):
            step = self._append_token(seq, token, entry)
            if record is None:
                record = step
            else:
                record.new_token_ids += step.new_token_ids
                if step.new_logprobs is not None:
                    record.new_logprobs += step.new_logprobs
                record.finish_reason = step.finish_reason
            if seq.finished:
                break
        return record

    def _append_token(self, seq: Sequence, token: int, logprobs) -> EngineOutput:
        req, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif seq.guide is not None and not seq.guide.accept(token):  # the mask allowed it: a backend fault
            log.error("request %s: the grammar rejected token %d it allowed: %s", req.request_id, token,
                      seq.guide.error)
            reason = "abort"
        elif seq.guide is not None and seq.guide.finished:  # complete, and nothing may follow
            reason = "grammar"
        elif self.scheduler.at_length(seq):
            reason = "length"
        record = EngineOutput(req.request_id, seq.index, [token], None if logprobs is None else [logprobs], reason)
        if not req.reported:
            self._reported(req, record)
        if reason:
            self.scheduler.finish(seq, reason)
            if req.finished:
                req.finish_time = time.monotonic()
                self.requests.pop(req.request_id, None)
        return record

    def _fail(self, requests, error: str) -> list[EngineOutput]:
        records = []
        for req in requests:
            EngineCore.abort(self, req.request_id)  # the core's: an output processor must still see the error
            records.append(self._reported(req, EngineOutput(req.request_id, finish_reason="abort", error=error)))
        return records

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_requests_running": len(self.scheduler.running), "num_requests_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage, "num_blocks": bm.num_blocks, "prefix_cache_queries": bm.prefix_queries,
                "prefix_cache_hits": bm.prefix_hits, "num_preemptions": self.scheduler.num_preemptions,
                "prompt_tokens": self.prompt_tokens_total, "generation_tokens": self.generation_tokens_total,
                "num_steps": self.num_steps, **(self.spec.stats() if self.spec is not None else {}),
                **(graph_replays(self.runner, self.spec.proposer) if self.spec is not None else {})}


class LLMEngine(EngineCore):
    """The engine core and the output processor in one process: `step()` gives `RequestOutput`s."""
    core = EngineCore  # the class whose step/enqueue/abort give the core's records (what the engine loop calls)

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, eos_token_ids=()):
        super().__init__(model, tokenizer, config, eos_token_ids)
        self.processor = OutputProcessor(tokenizer)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, stream: bool = True,
                    lora_request: LoRARequest | None = None) -> Request:
        """stream: an output each step the request progresses in; else only its final one."""
        return self.enqueue(self.make_request(request_id, prompt, params, lora_request), stream)

    def enqueue(self, request: Request, stream: bool = True) -> Request:
        super().enqueue(request)
        self.processor.add_request(request, stream)
        return request

    def abort(self, request_id: str, index: int | None = None) -> bool:
        if index is None:
            self.processor.abort(request_id)
        return super().abort(request_id, index)

    def step(self, batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        processed = self.processor.process(super().step(batch))
        for request_id, index in processed.stopped:  # stop strings: the engine drops those samples now
            super().abort(request_id, index)
        return processed.outputs
