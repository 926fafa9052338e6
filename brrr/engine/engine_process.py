"""The engine side of `brrr serve`: an EngineCore stepping in a process of its own, so that its per-step Python never
waits on the HTTP process's GIL (event loop, JSON and SSE for every stream) and the other way round.

`run_engine_process` is the spawned process: it loads the model from the same arguments the server got (`EngineSpec`;
nothing heavy is pickled), warms the engine up, says "ready" with what the server needs to know (`EngineInfo`), then
runs `EngineLoop` on an `EngineCore`. The loop also runs in a thread of the server process (`AsyncLLM(engine)`, for
tests that hand over an engine object): same messages, same code. Detokenization and stop strings happen on the
server's side (output_processor.py).

Over two one-way pipes:
  server -> engine:  ("add", Request) | ("abort", request_id, sample index or None) | ("add_lora", LoRARequest)
                     | ("remove_lora", lora_int_id) | ("shutdown",)
  engine -> server:  ("ready", EngineInfo, stats) or ("failed", message) once at start; then, for each step that
                     made progress or applied commands, ("step", [EngineOutput], stats). stats are
                     `EngineCore.stats()` plus free blocks and unfinished requests, so /metrics and tests read the
                     engine's state without asking it.
The engine process ignores SIGINT and SIGTERM: the server process decides when it stops (after draining). It exits
on "shutdown", or when the server's end of the pipe closes, which is what happens when the server dies.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from brrr.config import EngineConfig
from brrr.engine.build import build_engine
from brrr.engine.core import EngineCore
from brrr.engine.engine_process_warmup import warm_up
from brrr.engine.llm_engine import LLMEngine
from brrr.engine.outputs import EngineOutput
from brrr.engine.sequence import Request
from brrr.errors import BrrrError
from brrr.kernels.quant import quant_tuning
from brrr.threads import use_cpu_threads

log = logging.getLogger("brrr.engine")
# Counters the warm-up moves; reported relative to where it left them, so metrics count only real requests.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
            "num_steps")
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_verify_steps", "spec_verify_graph_steps", "spec_draft_graph_steps")
DISAGG_COUNTERS = ("kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds")
PARENT_CHECK_SECONDS = 1.0  # while idle, how often the engine process checks that the server still exists


@dataclass
class EngineSpec:
    """How to build the engine in the engine process: the server's own arguments, small enough to pickle."""

    model: str  # a resolved model directory
    dtype: str = "auto"
    device: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    cpu_threads: int | None = None  # torch threads on CPU (default: brrr.threads' policy)
    warm_up: bool = True
    log_level: str = "INFO"


@dataclass
class EngineInfo:
    """What the server needs to know about the engine to validate requests and describe itself."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    pid: int
    warm_up_seconds: float = 0.0
    # LoRA (None: the engine serves no adapters): the rank limit and the shape of every projection an adapter may
    # adapt, so the server checks an adapter before any request names it
    max_lora_rank: int | None = None
    lora_shapes: dict[str, tuple[int, int]] | None = None
    kv_budget_blocks: int | None = None  # KV eviction: the most blocks a sequence holds (None: no eviction)
    kv_whole_prompt: bool = False  # KV eviction: a prefill holds its whole prompt's blocks first (snapkv, h2o)

    @classmethod
    def of(cls, engine: EngineCore, warm_up_seconds: float = 0.0) -> "EngineInfo":
        bm, lora = engine.block_manager, engine.lora
        return cls(engine.max_model_len, engine.model.config.vocab_size, bm.num_blocks, bm.block_size,
                   engine.eos_token_ids, str(engine.runner.device), os.getpid(), warm_up_seconds,
                   lora.max_lora_rank if lora else None, lora.shapes if lora else None,
                   None if engine.scheduler.eviction is None else engine.scheduler.eviction.budget,
                   engine.scheduler.eviction is not None and engine.scheduler.eviction.whole_prompt)


def engine_stats(engine: EngineCore, baseline: dict | None = None) -> dict:
    stats = engine.stats()
    for key in COUNTERS + SPEC_COUNTERS + DISAGG_COUNTERS if baseline else ():
        if key in stats:  # the spec_decode_* and kv_transfer* counters exist when their feature is on
            stats[key] -= baseline[key]
    if baseline and "spec_decode_num_accepted_tokens_per_pos" in stats:
        stats["spec_decode_num_accepted_tokens_per_pos"] = [
            a - b for a, b in zip(stats["spec_decode_num_accepted_tokens_per_pos"],
                                  baseline["spec_decode_num_accepted_tokens_per_pos"])]
    stats["num_free_blocks"] = engine.block_manager.num_free_blocks
    stats["num_unfinished_requests"] = len(engine.requests)
    stats["num_unfinished_seqs"] = engine.scheduler.num_unfinished
    return stats


class EngineLoop:
    """Applies commands between steps, steps while there is work, and sends one message per step. Blocks on the
    command pipe while idle."""

    def __init__(self, engine: EngineCore, commands: Connection, outputs: Connection, baseline: dict | None = None,
                 parent_pid: int | None = None):
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.baseline, self.parent_pid = baseline, parent_pid
        # the core's records, also from an LLMEngine (whose own step() would assemble outputs in this process)
        core = engine.core if isinstance(engine, LLMEngine) else engine
        self.step, self.abort, self.enqueue = core.step, core.abort, core.enqueue
        self.failed: list[EngineOutput] = []  # requests the engine refused, sent with the next message
        # BRRR_ENGINE_TRACE=FILE (benchmarks): one line per step, written at shutdown: when it started, when the
        # step returned, when its message was sent, and the engine's counters after it
        self.trace_path = os.environ.get("BRRR_ENGINE_TRACE")
        self.trace: list | None = [] if self.trace_path else None

    def run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self._wait_for_commands()
                applied = self._apply_commands()
                if applied is None:
                    return
                start = time.perf_counter()
                records = self.step() if self.engine.has_unfinished_requests() else []
                stepped = time.perf_counter()
                if records or applied or self.failed:
                    if self.failed:
                        records, self.failed = self.failed + records, []
                    stats = engine_stats(self.engine, self.baseline)
                    self.outputs.send(("step", records, stats))
                    if self.trace is not None:
                        self.trace.append((start, stepped, time.perf_counter(), stats))
                failure = self.engine.runner.failure  # tensor-parallel workers gone
                if failure:  # the step's requests have their error; the server now reports the engine gone (503)
                    raise BrrrError(failure)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            log.info("the server closed its end of the engine pipe; the engine stops")
        except BaseException as e:  # a bug: tell the server why before going away
            log.exception("the engine loop failed")
            try:
                self.outputs.send(("failed", f"the engine loop failed: {type(e).__name__}: {e}"))
            except OSError:
                pass
        finally:
            self.outputs.close()

    def _wait_for_commands(self) -> None:
        while not self.commands.poll(PARENT_CHECK_SECONDS):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise EOFError("the server process is gone")

    def _apply_commands(self) -> bool | None:
        """Every command waiting in the pipe. None: told to shut down; else whether anything was applied."""
        applied = False
        while self.commands.poll():
            command = self.commands.recv()
            kind = command[0]
            if kind == "add":
                request: Request = command[1]
                try:
                    self.enqueue(request)
                except BrrrError as e:
                    self.failed.append(EngineOutput(request.request_id, finish_reason="abort", error=str(e)))
            elif kind == "abort":
                self.abort(command[1], command[2])
            elif kind == "add_lora":  # the server checked it; loading now spares its first request the read
                try:
                    self.engine.add_lora(command[1])
                except BrrrError as e:
                    log.warning("adapter %r: %s", command[1].lora_name, e)
            elif kind == "remove_lora":
                self.engine.remove_lora(command[1])
            elif kind == "shutdown":
                if self.trace:
                    write_trace(self.trace_path, self.trace)
                return None
            else:
                raise ValueError(f"unknown engine command {kind!r}")
            applied = True
        return applied


def write_trace(path: str, trace: list) -> None:
    import json

    with open(path, "w") as f:
        for start, stepped, sent, stats in trace:
            f.write(json.dumps({"start": start, "stepped": stepped, "sent": sent, **stats}) + "\n")


def engine_for(spec: EngineSpec, core: bool = False):
    """The engine `spec` describes: an EngineCore for the engine process (core), else an LLMEngine."""
    pretrained, engine = build_engine(spec.model, spec.dtype, spec.device, spec.config, core=core)
    if next(pretrained.model.parameters()).device.type == "cpu":
        use_cpu_threads(spec.cpu_threads)  # brrr's one policy: the free cores but one (the HTTP process's)
    return engine


def run_engine_process(spec: EngineSpec, commands: Connection, outputs: Connection, parent_pid: int) -> None:
    """The engine process's main: build, warm up, report ready (or why not), then serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the server drains first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s[engine]: %(message)s")
    try:
        engine = engine_for(spec, core=True)
        baseline, seconds = None, 0.0
        if spec.warm_up:
            start = time.perf_counter()
            with quant_tuning():  # the quantized matmuls' prefill shapes: tuned here, never while serving
                warm_up(engine)
            seconds = time.perf_counter() - start
            baseline = engine_stats(engine)
            log.info("warm-up: %d steps in %.1f s", baseline["num_steps"], seconds)
        # What start-up made (torch's modules, the model) lives as long as the process: out of the collector's
        # sight, full collections stay short instead of pausing a step for every object torch ever imported.
        gc.collect()
        gc.freeze()
        outputs.send(("ready", EngineInfo.of(engine, seconds), engine_stats(engine, baseline)))
    except BaseException as e:  # noqa: BLE001 - whatever it is, the server reports it and exits
        if isinstance(e, BrrrError):
            message = str(e)
        else:
            message = f"{type(e).__name__}: {e}"
            log.exception("engine start-up failed")
        try:
            outputs.send(("failed", message))
        except OSError:
            pass
        _exit(1)
    EngineLoop(engine, commands, outputs, baseline, parent_pid).run()
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown, which takes seconds with torch and a large KV cache, and which nothing
    here needs: the pipes are closed and the logs flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
