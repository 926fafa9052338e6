"""The decode instance and the router of a disaggregated engine (DistServe's split of prefill and decode).

`DisaggEngineCore` is a router in front of an EngineCore (the decode instance: scheduler, block manager, runner and
sampler on the decode device), by composition: it takes the core's place (the same methods: enqueue, abort, step,
stats) and sends each new request to a prefill instance (disagg_prefill.py) instead of the core's queue; what it
does not do itself is the core's (attribute reads pass through). A routed request goes through:

  prefill   sent to the instance with the fewest outstanding requests
  ready     the instance computed the prompt and sampled the first token: its records (first token, logprobs,
            prompt logprobs) go out now, so the time to first token is the prefill instance's
  pull      this pool had room: blocks allocated, ("pull", id) sent, the receive queued (disagg_instances.py)
  decoding  the KV is in the blocks: the sequence joins the running batch as if it had prefilled here

Everything else (streaming, stop strings, cancellation) is the engine's as co-located. A request the prefill
instances cannot take (n > 1: its samples share the prompt's blocks here; a prompt larger than their pools) is
prefilled here. An instance that dies fails the requests it holds (prefilling, ready or in transfer) with its exit
reason and is dropped; the decode instance keeps decoding the rest. With none left, prompts are prefilled here.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections

import torch

from brrr.distributed.disagg_instances import PrefillInstance, PrefillInstances
from brrr.distributed.disagg_transfer import kv_shape, scatter_blocks
from brrr.engine.core import EngineCore
from brrr.engine.outputs import EngineOutput
from brrr.engine.sequence import Request
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")
IDLE_WAIT_S = 0.002  # nothing to decode: how long a step waits for an instance's message before returning
# an instance with prompts to compute that answers nothing for this long is hung: it is stopped, its requests fail
PREFILL_SILENCE_S = 120.0


@dataclass
class Routed:
    request: Request
    instance: PrefillInstance
    phase: str = "prefill"  # prefill | ready | pull
    first_tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0  # tokens whose KV the instance computed
    num_blocks: int = 0
    blocks: list[int] = field(default_factory=list)  # this pool's blocks, allocated at the pull
    aborted: bool = False  # aborted while its KV was in flight: the blocks are freed when it lands


class DisaggEngineCore:
    def __init__(self, model, tokenizer=None, config=None, eos_token_ids=(), instances: PrefillInstances = None):
        if instances is None:
            raise BrrrError("a disaggregated engine needs its prefill instances: build it with "
                            "LLM(model, disaggregate=...) or brrr serve --disaggregate")
        # the decode instance is an engine of its own; the flag is the router's (a plain core refuses it)
        self.core = EngineCore(model, tokenizer, dataclasses.replace(config, disaggregate=None), eos_token_ids)
        self.config = config
        self.instances = instances
        instances.check_layout(self.runner.kv_caches, self.block_manager.block_size)
        self.routed: dict[str, Routed] = {}
        self.ready: deque[str] = deque()  # prefilled, waiting for room here, in arrival order
        self.in_transfer = 0
        self.kv_transfers = self.kv_transfer_bytes = 0
        self.kv_transfer_seconds = 0.0

    def __getattr__(self, name):
        if name == "core":  # not set yet (a failed __init__)
            raise AttributeError(name)
        return getattr(self.core, name)  # the decode instance's scheduler, runner, tokenizer, ...

    # ---- requests ---------------------------------------------------------------------------------------------
    def make_request(self, *args, **kwargs) -> Request:
        return self.core.make_request(*args, **kwargs)

    def add_request(self, request_id: str, prompt, params=None, lora_request=None) -> Request:
        return self.enqueue(self.core.make_request(request_id, prompt, params, lora_request))

    def enqueue(self, request: Request) -> Request:
        instance = self._instance_for(request)
        if instance is None:
            return self.core.enqueue(request)
        if request.request_id in self.requests or request.request_id in self.routed:  # (a cancelled one in flight)
            raise BrrrError(f"request_id {request.request_id!r} is already in use")
        self.core.requests[request.request_id] = request
        self.core._activate(request)
        self.routed[request.request_id] = Routed(request, instance)
        instance.outstanding += 1
        if not instance.prefilling:  # busy from now: its silence counts from here
            instance.heard = time.monotonic()
        instance.prefilling += 1
        try:  # the instance needs only the ids (and no sequences yet)
            instance.send(("add", Request(request.request_id, None, request.prompt_token_ids, request.params,
                                          request.arrival_time)))
        except OSError:
            pass  # it is gone: the next step fails the requests it held, this one among them
        return request

    def _instance_for(self, request: Request) -> PrefillInstance | None:
        if request.params.n > 1:
            return None
        blocks = self.block_manager.blocks_for(len(request.prompt_token_ids))
        # an instance that exited while this engine idled is dropped at the next poll: route around it already
        fits = [i for i in self.instances.alive() if blocks <= i.num_blocks and i.proc.exitcode is None]
        return min(fits, key=lambda i: i.outstanding) if fits else None

    def abort(self, request_id: str, index: int | None = None) -> bool:
        routed = self.routed.get(request_id)
        if routed is None:
            return self.core.abort(request_id, index)
        if routed.phase == "pull":  # the receive is posted: its blocks are freed when it completes
            routed.aborted = True
        else:
            self._forget(request_id)
            if routed.instance.lost is None:
                try:
                    routed.instance.send(("abort", request_id))  # frees its blocks there
                except OSError:
                    pass
        request = self.requests.pop(request_id, None)
        if request is not None:
            request.finish_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        # a cancelled request's KV still in flight: stepping on until it lands gives its blocks back
        return bool(self.requests) or self.in_transfer > 0

    def _forget(self, request_id: str) -> Routed:
        routed = self.routed.pop(request_id)
        routed.instance.outstanding -= routed.phase != "pull"
        routed.instance.prefilling -= routed.phase == "prefill"
        if routed.phase == "ready":
            self.ready.remove(request_id)
        return routed

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self, batch=None):
        records = self._poll()
        self._pull()
        if self.scheduler.num_unfinished or self._queued is not None or batch is not None:
            return records + self.core.step(batch)
        if not records and self.routed:  # only prefill-side work: wait for it a moment instead of spinning
            conns = [i.conn for i in self.instances.alive()]
            if conns and not self.in_transfer:
                wait_connections(conns, IDLE_WAIT_S)
            else:
                time.sleep(IDLE_WAIT_S / 4)
        return records

    def _poll(self) -> list[EngineOutput]:
        """Every instance's messages and finished transfers; an instance gone fails what it held."""
        records = []
        for instance in self.instances.alive():
            why = None
            try:
                while why is None and instance.conn.poll(0):
                    message = instance.conn.recv()
                    instance.heard = time.monotonic()
                    if message[0] == "error":
                        why = f"{instance.name} failed: {message[1].strip().splitlines()[-1]}"
                    else:
                        records += self._on_message(instance, *message)
            except (EOFError, OSError):
                why = instance.exit_reason() or f"{instance.name} closed its pipe"
            while not instance.done.empty() and why is None:
                request_id, buf, seconds, error = instance.done.get()
                if error is not None:
                    why = f"the KV transfer from {instance.name} broke ({error})"
                    self.in_transfer -= 1
                    records += self._fail_one(request_id, why)
                else:
                    records += self._landed(request_id, buf, seconds)
            why = why or instance.exit_reason()
            silent = time.monotonic() - instance.heard
            if why is None and instance.prefilling and silent > PREFILL_SILENCE_S:
                why = (f"{instance.name} answered nothing for {silent:.0f} s with {instance.prefilling} prompt(s) to "
                       "compute (hung)")
            if why is not None:
                records += self._lose(instance, why)
        return records

    def _on_message(self, instance: PrefillInstance, kind: str, request_id: str, recs, *rest) -> list[EngineOutput]:
        routed = self.routed.get(request_id)
        if routed is None:  # aborted meanwhile (the instance frees what it kept)
            return []
        request, now = routed.request, time.monotonic()
        request.reported = True  # the instance's first record carries the scheduling facts
        for rec in recs:
            if rec.new_token_ids and request.first_token_time is None:
                request.first_token_time = now
            if rec.new_prompt_logprobs:  # a recompute here (after a preemption) must not report them again
                request.num_prompt_logprobs += len(rec.new_prompt_logprobs)
            if rec.first_scheduled_time is not None:
                request.first_scheduled_time = rec.first_scheduled_time
                request.num_cached_tokens = rec.num_cached_tokens
        if kind == "finished":  # its first token ended it (or the instance refused it)
            self._forget(request_id)
            self.requests.pop(request_id, None)
            request.finish_time = now
        else:  # "prefilled"
            instance.prefilling -= 1
            routed.num_blocks, routed.prompt_len = rest
            routed.first_tokens = [t for rec in recs for t in rec.new_token_ids]
            routed.phase = "ready"
            self.ready.append(request_id)
            self.core.prompt_tokens_total += routed.prompt_len - request.num_cached_tokens
        self.core.generation_tokens_total += sum(len(rec.new_token_ids) for rec in recs)
        return recs

    def _pull(self) -> None:
        """Pull ready requests, oldest first, while this pool and batch have room (for the prompt's blocks and the
        next token's), and no sequence preempted here waits for room (it is older)."""
        bm, sched = self.block_manager, self.scheduler
        while self.ready and not sched.waiting:
            routed = self.routed[self.ready[0]]
            if (bm.num_free_blocks < bm.blocks_for(routed.prompt_len + 1)
                    or len(sched.running) + self.in_transfer >= self.config.max_num_seqs):
                return
            self.ready.popleft()
            routed.blocks = [bm.allocate_block() for _ in range(routed.num_blocks)]
            routed.phase = "pull"
            routed.instance.outstanding -= 1
            self.in_transfer += 1
            try:
                routed.instance.pull(routed.request.request_id, kv_shape(self.runner.kv_caches, routed.num_blocks),
                                     self.runner.dtype)
            except OSError:
                pass  # gone: the receive fails, and the instance is dropped at the next poll

    def _landed(self, request_id: str, buf, seconds: float) -> list[EngineOutput]:
        self.in_transfer -= 1
        routed = self.routed.pop(request_id)
        if routed.aborted:
            self.block_manager.release_blocks(routed.blocks)
            return []
        scatter_blocks(self.runner.kv_caches, routed.blocks, buf)
        if buf.is_cuda:  # received on the transfer thread's stream, read here on this one
            buf.record_stream(torch.cuda.current_stream(buf.device))
        request = routed.request
        seq = self.scheduler.add_prefilled(request, request.prompt_token_ids + routed.first_tokens, routed.blocks)
        self.adopt(seq, routed.first_tokens)  # the features' state past the tokens the prefill instance sampled
        self.kv_transfers += 1
        self.kv_transfer_bytes += buf.nbytes
        self.kv_transfer_seconds += seconds
        log.info("request %s: KV of %d prompt tokens (%d blocks, %.2f MiB) from %s in %.2f ms", request_id,
                 len(request.prompt_token_ids), routed.num_blocks, buf.nbytes / 2**20, routed.instance.name,
                 seconds * 1e3)
        return []

    # ---- failures ---------------------------------------------------------------------------------------------
    def _fail_one(self, request_id: str, why: str) -> list[EngineOutput]:
        routed = self.routed.get(request_id)
        if routed is None:
            return []
        self._forget(request_id)
        self.block_manager.release_blocks(routed.blocks)
        request = self.requests.pop(request_id, None)
        if request is None or routed.aborted:
            return []
        request.finish_time = time.monotonic()
        request.reported = True
        return [EngineOutput(request_id, finish_reason="abort", error=f"{why}; the request failed")]

    def _lose(self, instance: PrefillInstance, why: str) -> list[EngineOutput]:
        """Take an instance out of service: stop its process (a gloo receive from it then fails at once; NCCL's
        is aborted), fail every request it held."""
        instance.lost = why
        log.error("%s; its requests fail, the decode instance keeps serving the others", why)
        if instance.proc.is_alive():
            instance.proc.kill()
        instance.proc.join(5)
        try:
            instance.group.abort()
        except Exception:  # noqa: BLE001 - already broken
            pass
        records = []
        for request_id in [r for r, routed in self.routed.items() if routed.instance is instance]:
            if self.routed[request_id].phase == "pull":
                self.in_transfer -= 1
            records += self._fail_one(request_id, why)
        instance.stop_receiving()
        if not self.instances.alive():
            log.warning("no prefill instance is left: prompts are prefilled on the decode instance from now on")
        return records

    def stats(self) -> dict:
        prefilling = sum(r.phase != "pull" for r in self.routed.values())
        return {**self.core.stats(), "kv_transfers": self.kv_transfers, "kv_transfer_bytes": self.kv_transfer_bytes,
                "kv_transfer_seconds": self.kv_transfer_seconds, "num_requests_prefilling": prefilling,
                "prefill_instances_alive": len(self.instances.alive())}

    def shutdown(self) -> None:
        self.instances.shutdown()


def load_disaggregated(model, dtype, device, config):
    """(Pretrained on the decode device, the engine core): the flag checked against the machine first, the prefill
    instances started (they load while this process loads the decode instance's copy), then joined."""
    from brrr.config.disaggregation import check_devices, instance_device
    from brrr.hub import resolve_model
    from brrr.pretrained import check_device, load

    d = config.disaggregate
    device = check_device(device)
    check_devices(d, device)
    path = resolve_model(model)
    instances = PrefillInstances(d.prefill, str(path), dtype, device, config)
    try:
        decode = instance_device(device, d.decode[0])
        if decode.type == "cuda":
            torch.cuda.set_device(decode)
        pretrained = load(path, dtype=dtype, device=decode)
        instances.connect(decode)
        engine = DisaggEngineCore(pretrained.model, pretrained.tokenizer, config, pretrained.eos_token_ids, instances)
    except BaseException:
        instances.shutdown()
        raise
    return pretrained, engine
