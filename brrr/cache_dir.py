"""Where brrr keeps what it computes once per machine (the quantized matmuls' tuned picks): $BRRR_CACHE_DIR, else
$XDG_CACHE_HOME/brrr, else ~/.cache/brrr. Read at each call, so a test or a process can point it elsewhere."""
from __future__ import annotations

import os


def cache_dir() -> str:
    if os.environ.get("BRRR_CACHE_DIR"):
        return os.environ["BRRR_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "brrr")
