"""`brrr train`'s task: a Llama-family model (brrr's own models/ code) trained from scratch on a `brrr data build`
directory, under torchrun over any layout (brrr.train.parallel). The loop is brrr/train/trainer.py's.

The model starts from GPT-2's initialisation; batches are windows of seq_len + 1 tokens of the train split; the
loss is the next-token cross-entropy (brrr.train.loss, chunked over the LM head); evaluation is that loss on the
validation split, per source and over all of them; the output directory is a Hugging Face model directory that
brrr and transformers load (rank 0 gathers a distributed run's final checkpoint into it).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from brrr.analysis.model import param_counts, training_flops_per_token
from brrr.errors import BrrrError
from brrr.loader import save_model
from brrr.models import model_class
from brrr.train.config import LoopConfig, ParallelConfig, split_flags
from brrr.token_data import TokenData
from brrr.train.moe_loss import MoELoss
from brrr.train.parallel import load_model_weights, predicted_memory
from brrr.train.parallel.context_parallel import layout_loss
from brrr.train.sampler import TrainWindows, eval_windows
from brrr.train.shapes import resolve_config
from brrr.train.tokenizer import tokenizer_config


@dataclass
class PretrainConfig:
    """Pretraining's own flags (the loop's and the layout's are LoopConfig and ParallelConfig)."""
    model: str  # shape, preset or config.json (brrr.train.shapes)
    data: str
    compile: bool = False
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1  # with activation_checkpointing: recompute every N-th layer only
    # MoE models (brrr/train/moe_loss.py): the load-balancing loss's weight (None: the config's
    # router_aux_loss_coef, transformers' field) and the router z-loss's (ST-MoE)
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    # DeepSeek-V3's auxiliary-loss-free balancing: gamma of the e_score_correction_bias update after each step
    # (0: off; DeepSeek-V3 used 0.001)
    moe_bias_update_speed: float = 0.0
    export_dtype: str = "auto"  # auto: bfloat16 when trained under bf16 autocast, else float32

    def check(self):
        if self.activation_checkpointing_every < 1:
            raise BrrrError(f"--activation-checkpointing-every must be >= 1, got {self.activation_checkpointing_every}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "moe_bias_update_speed"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise BrrrError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.export_dtype not in ("auto", "float32", "bfloat16"):
            raise BrrrError(f"--export-dtype must be auto, float32 or bfloat16, got {self.export_dtype!r}")


@dataclass(init=False)
class TrainConfig:
    """`brrr train`'s flags, composed: the loop's, the layout's and pretraining's. Built from flat flags, as the CLI
    passes them: TrainConfig(model, data, out, seq_len=..., tp=..., compile=...)."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: PretrainConfig

    def __init__(self, model: str, data: str, out: str, **flags):
        self.task, self.loop, self.parallel = split_flags(flags, PretrainConfig(model, data), LoopConfig(out),
                                                          ParallelConfig())

    def make_task(self) -> "PretrainTask":
        return PretrainTask(self.task)


def build_model(cfg, device, seed: int = 0) -> nn.Module:
    """A freshly initialised fp32 model: N(0, 0.02) matrices, residual-output projections (o_proj, down_proj)
    scaled by 1/sqrt(2 * layers) as in GPT-2, zero biases, unit norm weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(cfg)(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
    return model


class PretrainTask:
    """brrr train (brrr/train/task.py's interface)."""
    command, run_name, parallel, eval_at_start = "train", "training", True, False

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg

    def configure(self, run):
        self.cfg.check()
        self.data, self.seq_len = TokenData(self.cfg.data), run.cfg.seq_len
        self.model_cfg = resolve_config(self.cfg.model, self.data.vocab_size, self.data.special_tokens,
                                        run.cfg.seq_len)
        if self.cfg.moe_bias_update_speed:
            self._check_bias_balancing(run.parallel_cfg)
        return self.model_cfg

    def _check_bias_balancing(self, parallel):
        scoring = self.model_cfg.router_scoring if self.model_cfg.num_experts else "none (a dense model)"
        if scoring != "sigmoid_grouped":
            raise BrrrError(f"--moe-bias-update-speed moves the routers' e_score_correction_bias, which only "
                            f"DeepSeek-V3's sigmoid_grouped routing has; {self.cfg.model} routes by {scoring}")
        if parallel.tp > 1 or parallel.pp > 1:  # the loads are counted by the loss's router hooks, per whole model
            raise BrrrError(f"--moe-bias-update-speed composes with --dp-shard, --dp-replicate and --cp; not with "
                            f"--tp or --pp (got --tp {parallel.tp} --pp {parallel.pp})")

    def build(self, run) -> nn.Module:
        cfg, loop = self.cfg, run.cfg
        self.model = self.checkpointed = run.parallelize(
            build_model(self.model_cfg, run.device, loop.seed), compile=cfg.compile,
            activation_checkpointing=cfg.activation_checkpointing, checkpoint_every=cfg.activation_checkpointing_every)
        self.batches = TrainWindows(self.data.splits["train"], loop.seq_len, loop.micro_batch, loop.seed,
                                    run.mesh.dp_rank, run.mesh.dp_world)
        self.loss = self.loss_fn = layout_loss(self.model, run.mesh)
        self.moe_loss = None
        if self.model_cfg.num_experts:  # router losses added, expert loads counted
            aux = self.model_cfg.router_aux_loss_coef if cfg.router_aux_loss_coef is None else cfg.router_aux_loss_coef
            self.loss = self.loss_fn = self.moe_loss = MoELoss(self.loss, self.model, self.model_cfg, aux,
                                                               cfg.router_z_loss_coef, cfg.moe_bias_update_speed)
        # one process compiles the whole loss (distributed runs compile per layer); fill the eager caches first
        # (AttnMeta, RoPE frequencies), so the graph sees no mutation
        if cfg.compile and not run.mesh.distributed:
            self.loss.meta(loop.micro_batch, loop.seq_len, run.device)
            self.model.model.rotary_emb(torch.zeros(1, dtype=torch.long, device=run.device), torch.float32)
            self.loss_fn = torch.compile(self.loss)
        self.flops_per_token = training_flops_per_token(self.model_cfg, loop.seq_len)
        return self.model

    def resume_key(self, run) -> dict:
        """The model, the data, and the batch geometry. The layout may change (the data position counts global
        micro-batches), the global batch may not: micro_batch is the sequences of one micro-batch over all
        data-parallel ranks."""
        c = run.cfg
        return {"model": self.model_cfg.to_hf(), "tokenizer_sha256": self.data.manifest["tokenizer_sha256"],
                "seq_len": c.seq_len, "micro_batch": c.micro_batch * run.mesh.dp_world,
                "grad_accum": c.grad_accum, "seed": c.seed}

    def describe(self, run) -> str:
        n, st = param_counts(self.model_cfg)["total"], run.state
        return (f"training {self.cfg.model}: {n / 1e6:.2f}M parameters on {run.device} ({run.gpu_name}); "
                f"{self.data.manifest['splits']['train']['tokens']:,} train tokens, "
                f"{run.tokens_per_step:,} tokens/step; steps {st['step']} -> {st['max_steps']}")

    def _val_rows(self, max_windows: int | None):
        """Per source: (name, [start offsets], window length) of the validation windows evaluated."""
        for name, (start, end) in self.data.source_ranges("val").items():
            starts, length = eval_windows(start, end, self.seq_len, max_windows)
            yield name, starts, length

    @torch.no_grad()
    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        """Mean next-token loss on the validation split, per source and over all of them (token-weighted)."""
        self.model.eval()
        val, mb = self.data.splits["val"], run.cfg.micro_batch
        sums, counts = {}, {}
        for name, starts, length in self._val_rows(max_windows):
            total, n = torch.zeros((), device=run.device, dtype=torch.float64), 0
            for i in range(0, len(starts), mb):
                chunk = starts[i: i + mb]
                rows = torch.from_numpy(val[chunk[:, None] + np.arange(length)].astype(np.int64)).to(run.device)
                total += run.train_step.eval_loss_sum(self.loss, rows[:, :-1], rows[:, 1:], run.autocast).double()
                n += rows[:, 1:].numel()
            if n:
                sums[name], counts[name] = total.item(), n
        self.model.train()
        out = {f"val_loss/{k}": sums[k] / counts[k] for k in sums}
        if counts:
            out["val_loss"] = sum(sums.values()) / sum(counts.values())
        return out

    def eval_line(self, val: dict) -> str:
        parts = " | ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in val.items() if "/" in k)
        loss = val.get("val_loss", float("nan"))
        return f"val loss {loss:.4f} (ppl {math.exp(loss):.2f})" + (f" | {parts}" if parts else "")

    def eval_tokens(self, max_windows: int | None) -> int:
        return sum(len(starts) * length for _, starts, length in self._val_rows(max_windows))

    def predicted_memory(self, run) -> dict | None:
        return predicted_memory(run.parallel_cfg, run.mesh, self.model_cfg, run.cfg.micro_batch, run.cfg.seq_len,
                                self.cfg.activation_checkpointing, run.gpu)

    def after_step(self, run) -> None:
        """MoE: the balancing biases move by the step's expert loads, summed over every rank (with --tp and --pp
        refused, the ranks are the data-parallel and context-parallel ones, which split the step's tokens)."""
        if self.moe_loss is not None:
            self.moe_loss.balance_step(dist.group.WORLD if run.mesh.distributed else None)

    def log_fields(self) -> dict:
        """MoE: tokens each expert of each MoE layer received since the last log line, on this rank."""
        return {"expert_tokens": self.moe_loss.take_counts()} if self.moe_loss is not None else {}

    def summary(self, run, final: dict) -> dict:
        return {"model": self.cfg.model, "params": param_counts(self.model_cfg)["total"],
                **{k.replace("val_loss", "val_ppl"): math.exp(v) for k, v in final.items()}}

    def export(self, run) -> dict:
        """config.json + model.safetensors (save_model), tokenizer files, generation_config.json."""
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(self.cfg.export_dtype)
        if dtype is None:
            dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
        model = self.model
        if run.mesh.distributed:  # rank 0 gathers the final checkpoint's shards into a plain model
            model = build_model(self.model_cfg, "cpu")
            load_model_weights(model, run.checkpoints.path)
        save_model(model, run.out, dtype)
        shutil.copyfile(self.data.tokenizer_file, run.out / "tokenizer.json")
        context = self.model_cfg.max_position_embeddings
        (run.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(context), indent=2) + "\n")
        gen = {"bos_token_id": self.model_cfg.bos_token_id, "eos_token_id": list(self.model_cfg.eos_token_ids),
               "do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_length": context}
        (run.out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        return {}
