"""Running `brrr train` on several CPU processes from a test: forked workers that join one gloo process group and
run a list of training configs in it (one group start-up for many cases), and torchrun launches of the CLI."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, configs: list):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from brrr.train.trainer import Trainer

    try:
        for cfg in configs:
            Trainer(cfg).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, configs: list):
    """Train each config in turn on `world` forked processes sharing one process group."""
    mp.start_processes(_worker, args=(world, free_port(), configs), nprocs=world, start_method="fork")


def train_losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out) / "train_log.jsonl").read_text().splitlines()
            if '"loss"' in line]


def torchrun(world: int, args: list[str], command: tuple[str, ...] = ("train",),
             entry: tuple[str, ...] = ("-m", "brrr"), **popen) -> subprocess.Popen:
    """`torchrun --nproc_per_node world -m brrr COMMAND ARGS` as a child process (entry: another script instead)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master-port",
           str(free_port()), *entry, *command, *args]
    # the repo first, then whatever the caller's path holds (packages installed beside it, e.g. with --target)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
