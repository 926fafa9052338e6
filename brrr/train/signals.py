"""How a training run is asked to stop: Ctrl-C, or the signals torchrun and cluster schedulers send, end the step in
progress and write a checkpoint before the process exits."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


@contextlib.contextmanager
def stop_on_signals():
    """While training, the first Ctrl-C (or SIGTERM / SIGUSR1) asks the loop to stop after the step it is in (which
    then writes a checkpoint and says where); a second one stops at once. Yields the list the handler appends to."""
    interrupted: list = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield interrupted
        return

    def handler(signum, frame):
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if os.environ.get("RANK", "0") == "0":  # torchrun signals every rank; one says so
            print(f"\n{name}: stopping after this step to write a checkpoint (Ctrl-C again to quit without one)",
                  file=sys.stderr, flush=True)

    # SIGTERM: what torchrun and cluster schedulers send before killing a job; SIGUSR1: a preemption warning
    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield interrupted
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
