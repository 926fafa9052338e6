"""A prefill instance: a process of its own with its own model copy, paged KV cache and engine core, started by the
decode side (disagg_instances.py), which sends it requests over a pipe.

It schedules and runs prompts like any engine (chunked prefill, prefix caching) and samples each request's first
token. A request that its first token ends (a stop token, max_tokens 1) is answered at once. Any other is parked:
taken out of the running batch with its prompt's blocks kept, and announced to the decode side ("prefilled", with
the records: the first token, its logprobs, prompt logprobs), which streams the first token to the client at once
and pulls the KV when its own pool has room. The pull is served by this process's reader thread (gather the blocks,
send them, on a CUDA stream of its own) while the main thread keeps prefilling; the main thread frees the blocks
once they are sent. Parked blocks count against this instance's pool, so a decode instance that falls behind slows
the prefill instance down instead of growing a queue.

  decode -> prefill:  ("add", Request) | ("pull", request_id) | ("abort", request_id) | ("stop",)
  prefill -> decode:  ("ready", layout) once; ("prefilled", request_id, [EngineOutput], num_blocks, prompt_len)
                      | ("finished", request_id, [EngineOutput]) | ("error", traceback) before it exits
"""
from __future__ import annotations

import queue
import threading
import traceback
from dataclasses import dataclass

import torch

from brrr.config import EngineConfig
from brrr.errors import BrrrError


@dataclass
class InstanceSpec:
    """How to build a prefill instance in its process: small enough to pickle."""
    model: str
    dtype: str
    device: str
    config: EngineConfig
    threads: int  # torch threads on CPU (the instances share the host's cores)


def prefill_main(spec: InstanceSpec, store_path: str, conn) -> None:
    from brrr.distributed.tp_worker import serve_child

    serve_child(conn, lambda: PrefillServer(spec, store_path, conn).run())


class PrefillServer:
    def __init__(self, spec: InstanceSpec, store_path: str, conn):
        from brrr.distributed.disagg_transfer import PREFILL_RANK
        from brrr.distributed.tp_worker import connect
        from brrr.engine.core import EngineCore
        from brrr.pretrained import load

        self.device = device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads)
        pretrained = load(spec.model, dtype=spec.dtype, device=device)
        # the tokenizer: requests with structured outputs compile their grammar here too
        self.engine = EngineCore(pretrained.model, pretrained.tokenizer, spec.config, pretrained.eos_token_ids)
        self.group = connect(store_path, PREFILL_RANK, 2, device).group
        self.conn, self.send_lock = conn, threading.Lock()
        self.parked: dict = {}  # request_id -> Sequence: prompt computed, blocks kept until the decode side pulls
        self._held: dict = {}  # request_id -> its records so far (prompt logprobs), sent with its first token
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # for the main thread, from the reader thread
        runner, bm = self.engine.runner, self.engine.block_manager
        k = runner.kv_caches[0][0]
        self._reply(("ready", {"num_blocks": bm.num_blocks, "block_size": bm.block_size, "dtype": k.dtype,
                               "block_shape": tuple(k.shape[1:]), "num_layers": len(runner.kv_caches)}))
        threading.Thread(target=self._read, name="brrr-prefill-reader", daemon=True).start()

    def _reply(self, message) -> None:
        with self.send_lock:
            self.conn.send(message)

    # ---- the reader thread: commands in, pulls served at once -------------------------------------------------
    def _read(self) -> None:
        from brrr.distributed.disagg_transfer import transfer_stream

        with transfer_stream(self.device):
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    self.commands.put(("stop",))
                    return
                if message[0] != "pull":
                    self.commands.put(message)
                    continue
                try:
                    self._push(message[1])
                except BaseException:  # the channel is broken: this instance is done
                    self.commands.put(("fatal", traceback.format_exc()))
                    return

    def _push(self, request_id: str) -> None:
        from brrr.distributed.disagg_transfer import gather_blocks, send_kv

        seq = self.parked[request_id]  # parked before it was announced, so before any pull for it
        blocks = seq.block_table[: self.engine.block_manager.blocks_for(seq.num_computed_tokens)]
        send_kv(self.group, gather_blocks(self.engine.runner.kv_caches, blocks))
        self.commands.put(("sent", request_id))

    # ---- the main thread: the engine ----------------------------------------------------------------------------
    def run(self) -> None:
        from brrr.engine.core import EngineCore

        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            try:
                commands = [] if busy else [self.commands.get()]  # idle: wait for work
                while True:
                    commands.append(self.commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if self._apply(command) is None:
                    return
            if engine.has_unfinished_requests():
                self._route(EngineCore.step(engine))

    def _apply(self, command) -> bool | None:
        from brrr.engine.core import EngineCore
        from brrr.engine.outputs import EngineOutput

        kind, engine = command[0], self.engine
        if kind == "add":
            request = command[1]
            try:
                EngineCore.enqueue(engine, request)
            except BrrrError as e:
                self._reply(("finished", request.request_id,
                             [EngineOutput(request.request_id, finish_reason="abort", error=str(e))]))
        elif kind == "sent":
            engine.block_manager.free(self.parked.pop(command[1]))
        elif kind == "abort":
            seq = self.parked.pop(command[1], None)
            self._held.pop(command[1], None)
            if seq is not None:
                engine.block_manager.free(seq)
            else:
                EngineCore.abort(engine, command[1])
        elif kind == "stop":
            return None
        elif kind == "fatal":
            raise RuntimeError(f"KV transfer to the decode instance failed:\n{command[1]}")
        return True

    def _route(self, records) -> None:
        """After a step: requests whose first token came are parked and announced, or answered if it ended them;
        records of prompts still prefilling (prompt logprobs) wait for their first token."""
        engine, pending = self.engine, {}
        for record in records:
            pending.setdefault(record.request_id, []).append(record)
        for request_id, recs in pending.items():
            self._held.setdefault(request_id, []).extend(recs)
            request = engine.requests.get(request_id)
            if request is None:  # finished (or failed) in this step
                self._reply(("finished", request_id, self._held.pop(request_id)))
            elif any(r.new_token_ids for r in recs):
                seq = request.seqs[0]
                engine.scheduler.running.remove(seq)
                del engine.requests[request_id]
                self.parked[request_id] = seq
                num_blocks = engine.block_manager.blocks_for(seq.num_computed_tokens)
                self._reply(("prefilled", request_id, self._held.pop(request_id), num_blocks,
                             seq.num_computed_tokens))
