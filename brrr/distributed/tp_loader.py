"""Loading a tensor-parallel engine's model: `load_tensor_parallel` checks N, starts the workers (tp_worker.py),
loads rank 0's shard while each worker loads its own, and sizes the KV cache once for all ranks; the shard it
returns carries `tp_group` (tp_group.RankZero), so the `ModelRunner` the engine builds on it runs every step on every
rank. `load_pretrained` is `brrr.load` for such an engine.

EAGLE under tensor parallelism: the draft head runs on rank 0 alone. Its inputs, the target's final hidden states,
are already whole and identical on every rank (each layer ends in an all-reduce), so nothing needs gathering per
step; it needs the whole embedding and LM head, which rank 0 assembles once at load (`DraftTarget`, (N-1)/N of the
two tables more memory on rank 0). Running the head on every rank instead would halve its LM-head reads per draft
but cost two collectives per draft token, a broadcast of the features per round, and a copy of the proposer's
state (its cache, its per-sequence positions) on every worker kept in step with rank 0's: a second protocol beside
the runner's, which this design removed. The draft model proposer runs on rank 0 the same way (its model whole).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from brrr.config import EngineConfig, ModelConfig
from brrr.distributed.quant_sharding import check_quantized
from brrr.distributed.shard_loader import load_shard
from brrr.distributed.sharding import Partition, check_tensor_parallel
from brrr.distributed.tp_group import RankZero
from brrr.distributed.tp_worker import WorkerGroup, gather_vocabulary, rank_device
from brrr.engine.model_runner import ModelRunner
from brrr.errors import BrrrError
from brrr.gguf.reader import is_gguf
from brrr.hub import resolve_model
from brrr.loader import resolve_dtype, weight_files
from brrr.serving_form import prepare_for_serving
from brrr.pretrained import Pretrained, check_device, stop_token_ids
from brrr.quant.checkpoint import quantization_config
from brrr.tokenizer import Tokenizer


class DraftTarget:
    """The model as an EAGLE head on rank 0 drafts with (`EagleProposer`'s target): the whole model's config, its
    embedding and its LM head, whole tables (each rank's shard holds only its vocabulary rows, whose lookups and
    logits need the other ranks' collectives)."""

    def __init__(self, config: ModelConfig, embedding: torch.Tensor, lm_head: torch.Tensor):
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.lm_head_weight = lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab], as the model's `compute_logits`."""
        return F.linear(hidden, self.lm_head_weight).float()


def load_tensor_parallel(source: Path | ModelConfig, n: int, dtype, device: torch.device, config: EngineConfig):
    """(rank 0's shard model, the engine config to build the engine with). source: a model directory, or a
    ModelConfig for random weights of its shape (benchmarks). N is checked against the config first, then the N-1
    workers start and every rank loads its own slices. On CUDA the KV cache is sized once for all ranks (each
    profiles the same forward; the smallest fits them all)."""
    path = None if isinstance(source, ModelConfig) else Path(source)
    cfg = source if path is None else ModelConfig.from_dir(path)
    check_tensor_parallel(cfg, n, device)
    qc = None if path is None else quantization_config(path)
    if qc:
        check_quantized(qc, Partition(cfg, 0, n))
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
        spec = config.speculative_config
        if spec is not None and spec.method == "eagle":  # the head drafts on rank 0 alone (DraftTarget)
            workers.send_all(("vocab", None))
            draft_target = DraftTarget(cfg, *gather_vocabulary(model))
        model = prepare_for_serving(model, config)
        if device.type == "cuda" and config.num_blocks is None and config.kv_cache_memory is None:
            args = (config.block_size, config.max_num_batched_tokens, config.gpu_memory_utilization, 0,
                    config.kv_cache_dtype)
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
    model.tp_group = RankZero(workers)  # what makes ModelRunner run every step on every rank
    if spec is not None and spec.method == "eagle":
        model.draft_target = draft_target
    return model, config


def load_pretrained(model: str | Path | None, dtype, device, config: EngineConfig):
    """`brrr.load` for a tensor-parallel engine: (Pretrained holding rank 0's shard, the engine config to use)."""
    device = check_device(device)
    path = resolve_model(model)
    if is_gguf(path):
        raise BrrrError(f"{path}: tensor parallelism loads safetensors shards by slice; a GGUF file runs on one GPU "
                        "(--tensor-parallel-size 1), or export the HF directory and shard that")
    tokenizer = Tokenizer.from_dir(path)
    net, config = load_tensor_parallel(path, config.tensor_parallel_size, dtype, device, config)
    return Pretrained(path, net, tokenizer, stop_token_ids(path, net.full_config, tokenizer)), config
