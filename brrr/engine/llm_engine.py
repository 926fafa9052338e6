"""LLMEngine: requests in, one scheduled step at a time, outputs out. Single-threaded; AsyncLLM drives it."""
from __future__ import annotations

import logging
import time

import torch

from brrr.config import EngineConfig
from brrr.engine.block_manager import BlockManager
from brrr.engine.model_runner import ModelRunner, kv_bytes_per_block
from brrr.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brrr.engine.sampler import PendingTokens, SampleRow, h2d
from brrr.engine.sampling_params import SamplingParams
from brrr.engine.scheduler import ScheduledBatch, Scheduler
from brrr.engine.sequence import Request, Sequence, Status
from brrr.errors import BrrrError
from brrr.kernels.dispatch import fast_path
from brrr.kernels.quant import quant_tuning
from brrr.models.llama import LlamaForCausalLM, pack_projections
from brrr.quant.linear import pack_quantized_projections
from brrr.tokenizer import IncrementalDecoder

log = logging.getLogger("brrr.engine")
CPU_KV_DEFAULT = 256 << 20  # zeroing more costs seconds at start-up on small CPU machines


def check_request(request_id: str, prompt: str | list[int], params: SamplingParams | None, tokenizer,
                  vocab_size: int, max_model_len: int, block_size: int, num_blocks: int) -> Request:
    """A validated, tokenized Request for an engine of these limits, or a BrrrError naming what is wrong. Shared by
    `LLMEngine.make_request` and the server process, which checks requests before they reach the engine process."""
    params = params or SamplingParams()
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
    return Request(request_id, text, ids, params)


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, eos_token_ids=()):
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        self.eos_token_ids = tuple(eos_token_ids)
        cfg, ec = model.config, self.config
        self.max_model_len = min(ec.max_model_len or cfg.max_context, cfg.max_context)
        pack = ec.pack_projections
        if pack is None:
            pack = fast_path(next(model.parameters()).device)
        if pack and isinstance(model, LlamaForCausalLM):
            pack_projections(model)  # before sizing the KV cache: the packed copy is made layer by layer
            pack_quantized_projections(model)  # the same for QuantLinear projections (W4A16 decode 1.09x -> 1.25x)
        num_blocks = self._num_blocks()
        self.block_manager = BlockManager(num_blocks, ec.block_size, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_batched_tokens, ec.max_num_seqs)
        with quant_tuning():  # the eager step before each graph capture tunes the quantized matmuls' decode shapes
            self.runner = ModelRunner(model, ec.block_size, num_blocks, self.max_model_len, ec.cuda_graphs,
                                      ec.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.prompt_tokens_total = self.generation_tokens_total = self.num_steps = 0
        # Outputs for every request that progressed (streaming), or only for those that finished (offline
        # batches: building a cumulative output per request per step is O(length) host work the GPU waits on).
        self.stream_outputs = True
        self._ahead: tuple[ScheduledBatch, PendingTokens] | None = None  # a decode step launched, tokens unread
        # outputs as wire deltas (engine_process_outputs.Delta tuples: only what is new), for the engine process
        self.delta_outputs = False
        self.schedule_log: list | None = None  # a list: each executed step's (computed, new) per sequence (benches)

    def _num_blocks(self) -> int:
        ec, model = self.config, self.model
        if ec.num_blocks:
            return ec.num_blocks
        p = next(model.parameters())
        per_block = kv_bytes_per_block(model.config, ec.block_size, p.dtype)
        if ec.kv_cache_memory:
            blocks = ec.kv_cache_memory // per_block
        elif p.device.type == "cuda":
            blocks = ModelRunner.profile_num_blocks(model, ec.block_size, ec.max_num_batched_tokens,
                                                    ec.gpu_memory_utilization)
        else:  # CPU: a fixed budget, but never more than every sequence at full length could use
            useful = ec.max_num_seqs * -(-self.max_model_len // ec.block_size)
            blocks = min(CPU_KV_DEFAULT // per_block, useful)
        if blocks < 1:
            raise BrrrError(f"no memory left for the KV cache (one block of {ec.block_size} tokens needs {per_block} "
                            "bytes); lower max_num_batched_tokens or raise gpu_memory_utilization/kv_cache_memory")
        return int(blocks)

    # ---- requests -------------------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> Request:
        """Validate and tokenize, without touching engine state (safe from another thread)."""
        bm = self.block_manager
        return check_request(request_id, prompt, params, self.tokenizer, self.model.config.vocab_size,
                             self.max_model_len, bm.block_size, bm.num_blocks)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> Request:
        return self.enqueue(self.make_request(request_id, prompt, params))

    def enqueue(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise BrrrError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(self._new_sequence(request, 0, list(request.prompt_token_ids)))
        return request

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        seq = Sequence(self._next_seq_id, request, index, token_ids, None if seed is None else seed + index)
        if self.tokenizer is not None:
            seq.decoder = IncrementalDecoder(self.tokenizer, request.params.skip_special_tokens)
        self._next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        request.finish_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self, batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        """Run one scheduled step (the scheduler's next one unless given) and apply its tokens.

        Steady decoding is pipelined: step t+1 is queued on the GPU, its input ids gathered there from step t's
        sampled tokens, before the host waits for t's tokens, so the host's bookkeeping for t (and its next
        scheduling) overlaps the GPU's work on t+1 instead of leaving the GPU idle between steps."""
        if self._ahead is not None:
            if batch is not None:
                raise BrrrError("step(batch) while a pipelined step is in flight: call step() without a batch")
            ahead, self._ahead = self._ahead, None
            if any(not seq.finished for seq, _ in ahead[0].items):
                return self._finish_decode(*ahead)
        explicit = batch is not None  # a caller's own batch: run just that, nothing queued behind it
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
            last = row + n - 1
            if seq.num_computed_tokens + n == len(seq.token_ids):  # this chunk reaches the end: sample
                req = seq.request
                group = [seq]
                if req.params.n > 1 and len(req.seqs) == 1:  # the prompt completes: fork the other samples
                    group += [self._new_sequence(req, i, list(seq.token_ids)) for i in range(1, req.params.n)]
                    forks.append((seq, group[1:]))
                sample_plan += [(last, s) for s in group]
            if seq.request.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_rows.append((seq, row, n))
            row += n
        logit_rows = [r for _, start, n in prompt_rows for r in range(start, start + n)]
        rows = [(r, self._sample_row(s)) for r, s in sample_plan]
        try:
            result, prompt_lp = self.runner.execute(batch, rows, logit_rows)
        except Exception as e:  # one bad step must not take the engine down: fail its requests, keep serving
            log.exception("step failed; aborting the %d requests in it", len(batch.items))
            return self._fail({s.request for s, _ in batch.items}, f"{type(e).__name__}: {e}")
        self.num_steps += 1
        touched = {}
        for seq, n in batch.items:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.commit_computed(seq)
            touched[seq.request.request_id] = seq.request
        for parent, children in forks:
            for child in children:
                self.block_manager.fork(parent, child)
                child.status = Status.RUNNING
                self.scheduler.running.append(child)
        if prompt_rows:
            self._record_prompt_logprobs(prompt_rows, prompt_lp)
        now = time.monotonic()
        for (_, seq), token, logprobs in zip(sample_plan, result.tokens, result.logprobs):
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            self._append_token(seq, token, logprobs)
        return [self._output(req) for req in touched.values() if self.stream_outputs or req.finished]

    def _pipelinable(self, batch: ScheduledBatch) -> bool:
        """Decode rows that need nothing from the host but their own state: no logprobs (read on the host), no
        penalties or min_tokens (they read the output so far, which would lag a step behind)."""
        return self.runner.can_launch(batch) and all(
            seq.request.params.logprobs is None and not seq.request.params.has_penalties
            and not seq.request.params.min_tokens and seq.request.params.n == 1 for seq, _ in batch.items)

    def _launch_next(self, batch: ScheduledBatch, pending: PendingTokens) -> None:
        """Queue step t+1 of the same sequences before step t's tokens reach the host, when nothing else could
        take a place in it: every running sequence decoding in this batch, and no waiting request that could be
        admitted now (a full batch, or too few free blocks for the queue's head, keeps it waiting either way; one
        admitted after a finish joins a step later). Sequences that step t ends for sure (length) are left out;
        ones a stop token ends are computed and their token dropped."""
        sched, bm = self.scheduler, self.block_manager
        if len(sched.running) != len(batch.items):
            return
        if sched.waiting and len(sched.running) < sched.max_num_seqs and bm.can_allocate(sched.waiting[0]):
            return
        rows, items = [], []
        for row, (seq, _) in enumerate(batch.items):
            if seq.finished or self._at_length(seq, pending=1):  # step t's token ends it
                continue
            rows.append(row)
            items.append((seq, 1))
        # step t+1 writes position len(token_ids): its block must exist
        grow = [seq for seq, _ in items if len(seq.block_table) < bm.blocks_for(len(seq.token_ids) + 1)]
        if not items or len(grow) > bm.num_free_blocks:
            return
        for seq in grow:
            seq.block_table.append(bm.allocate_block())
        nxt = ScheduledBatch(items)
        if self.schedule_log is not None:
            self.schedule_log.append([(seq.num_computed_tokens + 1, 1) for seq, _ in items])
        sample_rows = [self._sample_row(seq, ahead=1) for seq, _ in items]
        index = h2d(rows, pending.device_tokens.device, torch.long)
        self._ahead = (nxt, self.runner.launch(nxt, sample_rows, (pending.device_tokens, index)))

    def _finish_decode(self, batch: ScheduledBatch, pending: PendingTokens) -> list[RequestOutput]:
        """Apply a launched decode step: queue the next one first, then wait for this one's tokens."""
        try:
            self._launch_next(batch, pending)
            tokens = pending.tokens()
        except Exception as e:
            log.exception("step failed; aborting the %d requests in it", len(batch.items))
            self._ahead = None
            return self._fail({s.request for s, _ in batch.items}, f"{type(e).__name__}: {e}")
        self.num_steps += 1
        now, touched = time.monotonic(), {}
        for (seq, _), token in zip(batch.items, tokens):
            if seq.finished:  # a stop token or an abort ended it while this step was in flight
                continue
            seq.num_computed_tokens += 1
            self.block_manager.commit_computed(seq)
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            self._append_token(seq, token, None)
            touched[seq.request.request_id] = seq.request
        return [self._output(req) for req in touched.values() if self.stream_outputs or req.finished]

    def _sample_row(self, seq: Sequence, ahead: int = 0) -> SampleRow:
        params = seq.request.params
        # The output so far is copied only for requests that read it (penalties, min_tokens): an O(length) slice
        # per sequence per step is host work the GPU would wait on.
        history = seq.output_ids if params.has_penalties or params.min_tokens else []
        return SampleRow(params, seq.seed, seq.num_output_tokens + ahead,
                         seq.request.prompt_token_ids, history, self._stop_ids(params))

    def _at_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether seq has reached max_tokens or the context, counting `pending` tokens not yet appended."""
        return (seq.num_output_tokens + pending >= seq.request.params.max_tokens
                or len(seq.token_ids) + pending >= self.max_model_len)

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)

    def _record_prompt_logprobs(self, prompt_rows, logprobs):
        offset = 0
        for seq, _, n in prompt_rows:
            req, k = seq.request, seq.request.params.prompt_logprobs
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first prompt token has no predecessor
            for i in range(n):
                pos = seq.num_computed_tokens - n + i + 1  # the token row i predicts
                if pos < req.num_prompt_tokens and pos == len(req.prompt_logprobs):
                    lp, target = logprobs[offset + i], req.prompt_token_ids[pos]
                    entry = {target: float(lp[target])}
                    if k:
                        top = lp.topk(k)
                        entry.update(zip(top.indices.tolist(), top.values.tolist()))
                    req.prompt_logprobs.append(entry)
            offset += n

    def _append_token(self, seq: Sequence, token: int, logprobs) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"  # the stop token's text is not part of the output
        elif seq.decoder is not None:
            before = len(seq.text)
            seq.text += seq.decoder.push(token)
            for stop in params.stop:
                at = seq.text.find(stop, max(0, before - len(stop) + 1))
                if at != -1:
                    seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    reason = "stop_string"
                    break
        if reason is None and self._at_length(seq):
            reason = "length"
        if reason in ("stop", "length") and seq.decoder is not None:
            seq.text += seq.decoder.flush()  # an incomplete UTF-8 tail held back for a next token that won't come
        if reason:
            reason = "stop" if reason == "stop_string" else reason
            self.scheduler.finish(seq, reason)
            if seq.request.finished:
                seq.request.finish_time = time.monotonic()
                self.requests.pop(seq.request.request_id, None)

    def _fail(self, requests, error: str) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            self.abort(req.request_id)
            out = self._output(req)
            if self.delta_outputs:  # the wire tuple: (request_id, finished, error, ...)
                out = out[:2] + (error,) + out[3:]
            else:
                out.error = error
            outputs.append(out)
        return outputs

    def _output(self, req: Request) -> RequestOutput:
        """The request's output after this step: cumulative, or with `delta_outputs` only what is new, as the engine
        process's wire tuple (engine_process_outputs.Delta), with no output object built per request per step."""
        if self.delta_outputs:
            return self._delta(req)
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        want_logprobs = req.params.logprobs is not None
        completions = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            end = len(seq.text) if seq.finished else max(seq.emitted_chars, len(seq.text) - holdback)
            delta_text = seq.text[seq.emitted_chars:end]
            seq.emitted_chars = end
            new_ids = seq.token_ids[seq.num_prompt_tokens + seq.emitted_tokens:]
            completions.append(CompletionOutput(seq.index, seq.text[:end], seq.output_ids, seq.finish_reason,
                                                list(seq.output_logprobs) if want_logprobs else None, delta_text,
                                                new_ids))
            seq.emitted_tokens = seq.num_output_tokens
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finish_time,
                                 req.num_cached_tokens)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, req.finished,
                             req.prompt_logprobs if req.params.prompt_logprobs is not None else None, metrics)

    def _delta(self, req: Request) -> tuple:
        params = req.params
        holdback = max(map(len, params.stop)) - 1 if params.stop else 0
        completions = []
        for seq in req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=lambda s: s.index):
            end = len(seq.text) if seq.finished else max(seq.emitted_chars, len(seq.text) - holdback)
            delta_text = seq.text[seq.emitted_chars:end]
            seq.emitted_chars = end
            sent = seq.emitted_tokens
            new_ids = seq.token_ids[seq.num_prompt_tokens + sent:]
            seq.emitted_tokens = sent + len(new_ids)
            logprobs = seq.output_logprobs[sent:] if params.logprobs is not None else None
            completions.append((seq.index, delta_text, new_ids, seq.finish_reason, logprobs))
        new_prompt_logprobs = None
        if params.prompt_logprobs is not None:
            new_prompt_logprobs = req.prompt_logprobs[req.prompt_logprobs_sent:]
            req.prompt_logprobs_sent = len(req.prompt_logprobs)
        metrics = (req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finish_time,
                   req.num_cached_tokens)
        return req.request_id, req.finished, None, metrics, new_prompt_logprobs, completions

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_requests_running": len(self.scheduler.running), "num_requests_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage, "num_blocks": bm.num_blocks, "prefix_cache_queries": bm.prefix_queries,
                "prefix_cache_hits": bm.prefix_hits, "num_preemptions": self.scheduler.num_preemptions,
                "prompt_tokens": self.prompt_tokens_total, "generation_tokens": self.generation_tokens_total,
                "num_steps": self.num_steps}
