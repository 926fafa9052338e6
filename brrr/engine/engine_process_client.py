"""The server's end of the engine (engine_process.py): starts it, in a spawned process or in a thread, sends it
commands through a writer thread (a large prompt fills the pipe; the event loop must not wait for the engine to
drain it), and reads its per-step messages on a reader thread, which keeps the latest stats and hands each step's
records to a callback. Knows when the engine is gone and why."""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from brrr.engine.engine_process import EngineInfo, EngineLoop, EngineSpec, engine_stats, run_engine_process
from brrr.engine.core import EngineCore
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")
PIPE_BYTES = 1 << 20  # pipe capacity: a burst of adds fits while the engine is mid-step
STOP_SECONDS = 30  # how long shutdown waits for the engine to finish its step and exit before killing it


def _one_way_pipe(ctx) -> tuple[Connection, Connection]:
    reader, writer = ctx.Pipe(duplex=False)
    try:  # Linux: the default 64 KiB holds ~30 adds of 512-token prompts; 1 MiB is what unprivileged users may set
        import fcntl

        fcntl.fcntl(writer.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass
    return reader, writer


class EngineClient:
    def __init__(self, commands: Connection, outputs: Connection, worker: multiprocessing.Process | threading.Thread):
        self.commands, self.outputs, self.worker = commands, outputs, worker
        self.info: EngineInfo | None = None
        self.stats: dict = {}  # the engine's stats as of its latest message
        self.failure: str | None = None  # why the engine is gone; None while it runs
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._pending: queue.SimpleQueue = queue.SimpleQueue()  # commands for the writer thread, in order
        self._writer = threading.Thread(target=self._write, name="brrr-engine-writer", daemon=True)
        self._writer.start()
        atexit.register(self.shutdown)  # before multiprocessing joins its children at exit, which would wait forever

    @classmethod
    def spawn(cls, spec: EngineSpec) -> "EngineClient":
        """Start the engine process (it loads the model itself). Call `wait_ready` next."""
        ctx = multiprocessing.get_context("spawn")  # fork would copy this process's threads and CUDA state
        command_reader, command_writer = _one_way_pipe(ctx)
        output_reader, output_writer = _one_way_pipe(ctx)
        process = ctx.Process(target=run_engine_process, name="brrr-engine",
                              args=(spec, command_reader, output_writer, os.getpid()))
        process.start()
        command_reader.close()  # only the engine holds these now, so each side sees EOF when the other dies
        output_writer.close()
        return cls(command_writer, output_reader, process)

    @classmethod
    def in_thread(cls, engine: EngineCore) -> "EngineClient":
        """Run the same loop on an engine object in a thread of this process (tests; no warm-up)."""
        command_reader, command_writer = multiprocessing.Pipe(duplex=False)
        output_reader, output_writer = multiprocessing.Pipe(duplex=False)

        def run():
            try:
                output_writer.send(("ready", EngineInfo.of(engine), engine_stats(engine)))
                EngineLoop(engine, command_reader, output_writer).run()
            finally:
                command_reader.close()
                output_writer.close()

        thread = threading.Thread(target=run, name="brrr-engine", daemon=True)
        thread.start()
        return cls(command_writer, output_reader, thread)

    # ---- start-up ---------------------------------------------------------------------------------------------
    def wait_ready(self) -> EngineInfo:
        """Block until the engine has loaded and warmed up. Raises BrrrError if it could not."""
        try:
            while not self.outputs.poll(1.0):
                if not self.worker.is_alive():
                    raise EOFError
            message = self.outputs.recv()
        except (EOFError, OSError):
            self.shutdown()
            raise BrrrError(f"the engine did not start: {self._exit_description()}") from None
        except BaseException:  # Ctrl-C while the model loads: stop it now rather than after it has loaded
            self.shutdown(timeout=0)
            raise
        if message[0] != "ready":
            self.shutdown()
            raise BrrrError(f"the engine did not start: {message[1]}")
        _, self.info, self.stats = message
        return self.info

    def start_reading(self, on_deltas: Callable[[list], None], on_failure: Callable[[str], None]) -> None:
        """From now on, a reader thread calls on_deltas(deltas) for each step message and on_failure(why) once if
        the engine goes away without being asked to."""
        self._reader = threading.Thread(target=self._read, args=(on_deltas, on_failure), name="brrr-engine-reader",
                                        daemon=True)
        self._reader.start()

    # ---- running ----------------------------------------------------------------------------------------------
    def send(self, command: tuple) -> None:
        """Queue a command for the engine and return at once (the writer thread sends it, in order)."""
        if self.failure is not None:
            raise BrrrError(f"the engine is not running: {self.failure}")
        if self._stopping:
            raise BrrrError("the engine is shutting down")
        self._pending.put(command)

    def _write(self) -> None:
        while True:
            command = self._pending.get()
            try:
                self.commands.send(command)
            except (OSError, ValueError):  # the engine is gone (the reader thread tells why) or the pipe closed
                return
            if command[0] == "shutdown":
                return

    @property
    def alive(self) -> bool:
        return self.failure is None and not self._stopping

    def _read(self, on_deltas, on_failure) -> None:
        reason = None
        try:
            while True:
                message = self.outputs.recv()
                if message[0] == "step":
                    _, deltas, self.stats = message
                    if deltas:
                        on_deltas(deltas)
                elif message[0] == "failed":
                    reason = message[1]
                    break
        except (EOFError, OSError):
            pass
        except Exception as e:  # a bug on this side: fail the requests rather than leave them waiting forever
            log.exception("reading the engine's outputs failed")
            reason = f"the server stopped reading the engine: {type(e).__name__}: {e}"
        if not self._stopping:
            self.failure = reason or self._exit_description()
            log.error("%s; requests in flight fail, and /health reports it", self.failure)
            on_failure(self.failure)

    def _exit_description(self) -> str:
        if isinstance(self.worker, threading.Thread):
            return "the engine thread stopped"
        self.worker.join(timeout=1.0)
        code = self.worker.exitcode
        if code is None:
            return "the engine process stopped answering"
        if code < 0:
            try:
                return f"the engine process was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"the engine process exited with code {code}"

    # ---- stopping ---------------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = STOP_SECONDS) -> None:
        """Tell the engine to stop after its current step, wait for it, and close the pipes. Idempotent."""
        atexit.unregister(self.shutdown)
        if self._stopping:
            return
        self._stopping = True
        self._pending.put(("shutdown",))  # after every command queued before it
        self._writer.join(timeout=timeout)
        self.worker.join(timeout=timeout)
        if isinstance(self.worker, multiprocessing.process.BaseProcess) and self.worker.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self.worker.kill()
            self.worker.join(timeout=5)
        self.commands.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self.outputs.close()
