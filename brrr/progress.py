"""A progress bar on stderr for long work (quantization, evaluation), with the time left: stdout stays the
command's result."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def progress(description: str, total: int, enabled: bool = True):
    """Yields advance(n=1); disabled, a no-op, so library callers pass their own choice through."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("left"), TimeRemainingColumn(), console=Console(stderr=True))
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
