"""Rank 0 of a tensor-parallel engine: the runner the engine core uses when tensor_parallel_size > 1, and the
loader that starts the workers and loads rank 0's shard (`load_tensor_parallel`).

The scheduler, the block manager and the sampler run once, here. Each step, rank 0 flattens the scheduled batch,
sends it to the workers, and every rank runs the same forward over its own shard and its own KV cache (the same
block ids on every rank: the block manager's decisions hold for all of them); the vocabulary-parallel lm_head
gathers the logits, and rank 0 samples them.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from brrr.config import EngineConfig, ModelConfig
from brrr.distributed.oneshot import LaunchWatchdog, choose_bound, rendezvous_begun, timed_rows
from brrr.distributed.tp_step import GraphInputs, StepInputs, forward_step, message_bytes, replay_step, time_all_reduce
from brrr.engine.model_runner import ModelRunner
from brrr.engine.sampler import SampleResult, SampleRow, h2d, sample
from brrr.engine.scheduler import ScheduledBatch
from brrr.engine.staging import pad_tables
from brrr.errors import BrrrError

log = logging.getLogger("brrr.engine")


class TensorParallelRunner(ModelRunner):
    """The ModelRunner of rank 0: the same KV cache and step, with the workers running each step beside it. On
    CUDA every rank captures the decode graphs with the NCCL collectives inside, and a decode step replays them on
    every rank. Steady decoding launches ahead as on one GPU: the step's positions, slots and block tables go to the
    workers from the host, and its input ids, the tokens rank 0 has just sampled on its GPU, are broadcast to them
    on the GPU before the graph (the host never waits for them)."""

    def __init__(self, model, block_size: int, num_blocks: int, max_model_len: int | None = None,
                 cuda_graphs: bool = False, max_graph_batch: int = 256, lora=None):
        workers = getattr(model, "tp_workers", None)
        if workers is None:
            raise BrrrError("tensor_parallel_size > 1 needs a sharded model: load it with "
                            "LLM(model, tensor_parallel_size=N) or brrr serve --tensor-parallel-size N")
        if lora is not None:
            raise BrrrError("LoRA adapters are not sharded yet: serve them with tensor_parallel_size 1")
        super().__init__(model, block_size, num_blocks, max_model_len, cuda_graphs=False, lora=None)
        self.workers, self.watchdog = workers, None
        workers.send_all(("cache", (block_size, num_blocks)))
        cfg = model.config
        if self.device.type == "cuda":  # before any capture: the graphs hold the chosen all-reduce
            self.choose_all_reduce(max_graph_batch)
        if cuda_graphs and self.device.type == "cuda" and cfg.rope.type != "dynamic":
            self.capture_cuda_graphs(max_graph_batch, -(-(max_model_len or cfg.max_context) // block_size))

    def capture_cuda_graphs(self, max_batch: int, max_blocks: int, capture=None) -> None:
        """Every rank captures the same graphs in the same order. capture: as ModelRunner's (picklable: the workers
        run it too)."""
        self.workers.send_all(("capture", (max_batch, max_blocks, capture)))
        super().capture_cuda_graphs(max_batch, max_blocks, capture)

    @property
    def failure(self) -> str | None:
        """Why the engine is down (a worker died or a collective failed), or None: the engine process's loop stops
        on it, so the server's /health reports 503."""
        return self.workers.down

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[tuple[int, SampleRow]], logit_rows: list[int] = (),
                want_hidden: bool = False) -> tuple[SampleResult, torch.Tensor | None, None]:
        """ModelRunner.execute across the ranks. Hidden states (an EAGLE proposer's input) are not gathered: the
        engine refuses EAGLE with tensor parallelism at start-up."""
        if want_hidden:
            raise BrrrError("hidden states are not gathered across tensor-parallel ranks (EAGLE needs them)")
        rows = [r for r, _ in sample_rows]
        if not logit_rows and self.can_launch(batch):
            logits = self._replay(batch)
            if rows != list(range(len(batch.items))):
                logits = logits.index_select(0, h2d(rows, self.device, torch.long))
            return sample(logits, [row for _, row in sample_rows]), None, None
        ids, positions, slots, seqlens, context_lens, tables = self._flatten(batch)
        tables = pad_tables(tables)
        step = StepInputs(list(batch.copies), np.array(ids, dtype=np.int64), positions, slots, seqlens, context_lens,
                          tables, np.array(rows + list(logit_rows), dtype=np.int64))
        logits = self._run("step", step, forward_step)
        result = sample(logits[: len(rows)], [row for _, row in sample_rows])
        extra = logits[len(rows):].log_softmax(-1) if logit_rows else None
        return result, extra, None

    def _replay(self, batch: ScheduledBatch, ids_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """ModelRunner._replay on every rank (the launch-ahead path's forward included)."""
        ahead = ids_from is not None
        step = GraphInputs(*self.decode_inputs(batch, ahead), ahead)
        return self._run("replay", step, functools.partial(replay_step, ids_from=ids_from))

    def _run(self, kind: str, step, run) -> torch.Tensor:
        """Send the step to the workers, run it here; a broken collective takes the group down."""
        self.workers.send_all((kind, step))
        if self.watchdog is None:
            return self._run_local(run, step)
        self.watchdog.begin()
        try:
            return self._run_local(run, step)
        finally:  # a step that failed is watched too: what it launched may still wait on a dead peer
            self.watchdog.mark()

    def choose_all_reduce(self, max_graph_batch: int, iters: int = 200) -> int:
        """Set up the one-shot all-reduce on every rank and time it against NCCL at the decode messages' sizes
        (`timed_rows`), inside CUDA graphs; route to it the messages up to the largest size at which it won
        (`choose_bound`). Returns that bound in bytes, 0 where NCCL takes everything; logs the choice in one line.
        Collective: every rank sets the bound rank 0 decided."""
        rows = timed_rows(max_graph_batch)
        capacity = -(-message_bytes(self, rows[-1]) // 16) * 16
        if rendezvous_begun():  # the workers are new processes; this one has met its peers before (oneshot.py)
            failed = [(0, "this process set up symmetric memory for an earlier engine, and this torch counts "
                          "rendezvous per process, not per group (pytorch/pytorch#196082): one engine per process")]
        else:
            self.workers.send_all(("oneshot_setup", capacity))
            errors = [self.model.tp_comm.setup_oneshot(self.device, capacity)]
            errors += [self.workers.receive(rank, "oneshot_setup", 600) for rank in range(1, self.workers.world)]
            failed = [(rank, e) for rank, e in enumerate(errors) if e]
        timings, bound = [], 0
        if failed:
            rank, why = failed[0]
            log.warning("tensor-parallel all-reduce: NCCL for every message (the one-shot all-reduce could not be "
                        "set up on rank %d: %s)", rank, why)
        else:
            for r in rows:
                timings.append((message_bytes(self, r), self._time_on_every_rank(r, iters, "nccl"),
                                self._time_on_every_rank(r, iters, "oneshot")))
            bound = choose_bound(timings)
            log.info("tensor-parallel all-reduce: one-shot up to %d bytes, NCCL above (us per all-reduce in a CUDA "
                     "graph, bytes: NCCL / one-shot: %s)", bound,
                     ", ".join(f"{b}: {n:.1f} / {'-' if o is None else f'{o:.1f}'}" for b, n, o in timings))
        self.workers.send_all(("oneshot_bound", bound))
        self.model.tp_comm.set_oneshot_bound(bound)
        if bound and self.watchdog is None:
            from brrr.distributed.tp_worker import COLLECTIVE_TIMEOUT_S

            self.watchdog = LaunchWatchdog(self.workers.procs, COLLECTIVE_TIMEOUT_S).start()
        return bound

    def time_all_reduce(self, rows: int, iters: int = 200) -> dict:
        """The all-reduce of a decode step of `rows` rows inside a CUDA graph (rank 0's clock; CUDA only):
        microseconds per all-reduce through NCCL and through the one-shot path (None where it is not set up or
        cannot take the message), which of them the engine's graphs run, and the largest message the one-shot path
        takes (bytes; 0: none)."""
        x = torch.empty(rows, self.model.full_config.hidden_size, dtype=self.dtype, device=self.device)
        comm = self.model.tp_comm
        return {"all_reduce_us_nccl": self._time_on_every_rank(rows, iters, "nccl"),
                "all_reduce_us_oneshot": self._time_on_every_rank(rows, iters, "oneshot"),
                "all_reduce_backend": "oneshot" if comm.routes_to_oneshot(x) else "nccl",
                "all_reduce_oneshot_max_bytes": comm.oneshot_bound}

    def _time_on_every_rank(self, rows: int, iters: int, backend: str) -> float | None:
        self.workers.send_all(("time_all_reduce", (rows, iters, backend)))
        mine = self._run_local(time_all_reduce, rows, iters, backend)
        for rank in range(1, self.workers.world):
            self.workers.receive(rank, "all_reduce_us", 60)
        return mine

    def _run_local(self, fn, *args):
        try:
            return fn(self, *args)
        except Exception as e:  # a collective broke: a peer died or timed out
            self.workers.fail(f"a tensor-parallel collective failed ({type(e).__name__}: {e})")
            raise BrrrError(self.workers.down) from None

    def shard_shapes(self) -> list[dict[str, tuple[tuple[int, ...], int]]]:
        """Each rank's parameters: {name: (shape, bytes)}, rank 0 first."""
        own = {n: (tuple(p.shape), p.nbytes) for n, p in self.model.named_parameters()}
        self.workers.send_all(("shards", None))
        return [own] + [self.workers.receive(rank, "shards", 60) for rank in range(1, self.workers.world)]

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.release_graphs()  # before the group
        self.workers.shutdown()


def load_tensor_parallel(source: Path | ModelConfig, n: int, dtype, device: torch.device, config: EngineConfig):
    """(rank 0's shard model, the engine config to build the engine with). source: a model directory, or a
    ModelConfig for random weights of its shape (benchmarks). N is checked against the config first, then the N-1
    workers start and every rank loads its own slices. On CUDA the KV cache is sized once for all ranks (each
    profiles the same forward; the smallest fits them all)."""
    from brrr.distributed.quant_sharding import check_quantized
    from brrr.distributed.shard_loader import load_shard
    from brrr.distributed.sharding import Partition, check_tensor_parallel
    from brrr.distributed.tp_worker import WorkerGroup, rank_device
    from brrr.loader import resolve_dtype, weight_files
    from brrr.quant.checkpoint import quantization_config
    from brrr.serving_form import prepare_for_serving

    path = None if isinstance(source, ModelConfig) else Path(source)
    cfg = source if path is None else ModelConfig.from_dir(path)
    check_tensor_parallel(cfg, n, device)
    qc = None if path is None else quantization_config(path)
    if qc:
        check_quantized(qc, Partition(cfg, 0, n))
    if config.enable_lora:
        raise BrrrError("tensor_parallel_size > 1 with enable_lora: LoRA adapters are not sharded yet")
    dtype = resolve_dtype(dtype, cfg, device)
    files = [] if path is None else weight_files(path)
    workers = WorkerGroup(n, cfg, path, files, dtype, device, config.pack_projections)
    try:
        device = rank_device(device, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = workers.connect(device)
        model = load_shard(path, files, Partition(cfg, 0, n), comm, dtype, device)
        workers.wait_ready()
        model = prepare_for_serving(model, config)
        if device.type == "cuda" and config.num_blocks is None and config.kv_cache_memory is None:
            args = (config.block_size, config.max_num_batched_tokens, config.gpu_memory_utilization)
            workers.send_all(("profile", args))
            blocks = [ModelRunner.profile_num_blocks(model, *args)]
            blocks += [workers.receive(rank, "blocks", 600) for rank in range(1, n)]
            if min(blocks) < 1:
                raise BrrrError(f"no memory left for the KV cache on tensor-parallel rank {blocks.index(min(blocks))}; "
                                "lower max_num_batched_tokens or raise gpu_memory_utilization")
            # as EngineCore caps its own: every sequence at full length, no more (the rest would only keep old prompts)
            max_len = min(config.max_model_len or cfg.max_context, cfg.max_context)
            useful = config.max_num_seqs * -(-max_len // config.block_size)
            config = dataclasses.replace(config, num_blocks=min(blocks + [useful]))
    except BaseException:
        workers.shutdown()
        raise
    model.tp_workers = workers
    return model, config


def load_pretrained(model: str | Path | None, dtype, device, config: EngineConfig):
    """`brrr.load` for a tensor-parallel engine: (Pretrained holding rank 0's shard, the engine config to use)."""
    from brrr.hub import resolve_model
    from brrr.pretrained import Pretrained, check_device, stop_token_ids
    from brrr.tokenizer import Tokenizer

    device = check_device(device)
    path = resolve_model(model)
    tokenizer = Tokenizer.from_dir(path)
    net, config = load_tensor_parallel(path, config.tensor_parallel_size, dtype, device, config)
    return Pretrained(path, net, tokenizer, stop_token_ids(path, net.full_config, tokenizer)), config
