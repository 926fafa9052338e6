"""`brrr distill`: train a student on a frozen teacher's next-token distributions (token-level knowledge
distillation), a task of the one training loop (brrr/train/trainer.py: schedule, AdamW, clipping, autocast,
logging, checkpoints, --resume, data parallelism under torchrun).

Each micro-batch of windows runs through the teacher (no gradients; its logits are computed on the fly, a chunk
of tokens at a time) and the student; the loss per token is

    alpha * CE(student, next token) + (1 - alpha) * T^2 * KL        (brrr/train/kd_loss.py: forward or reverse)

so --alpha 1 is plain hard-label training on the same data (the baseline distillation is measured against).
The student is an HF model directory (a smaller trained model, or a pruned one: `brrr prune`'s zeros are kept, the
gradient of every pruned weight is masked, so AdamW never moves it off zero) or a training shape, preset or
config.json started from GPT-2's initialisation. Evaluation is the student's cross-entropy on the validation split
and its forward KL to the teacher at T = 1 (the distance distillation closes). The output is an HF directory with
the teacher's tokenizer files.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from brrr.analysis.model import param_counts, training_flops_per_token
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.hub import resolve_model
from brrr.kernels import AttnMeta
from brrr.loader import load_model, save_model
from brrr.quant.calib import load_tokens
from brrr.quant.checkpoint import TOKENIZER_FILES, quantization_config
from brrr.quant.linear import projections
from brrr.token_data import TokenData
from brrr.tokenizer import Tokenizer
from brrr.train.config import LoopConfig, ParallelConfig, split_flags
from brrr.train.kd_loss import KINDS, kd_loss
from brrr.train.parallel import load_model_weights
from brrr.train.pretrain import build_model
from brrr.train.sampler import TrainWindows, eval_windows
from brrr.train.shapes import resolve_config

# the loop's defaults for distillation (a student that starts trained, or small: fewer steps than pretraining)
DISTILL_LOOP = dict(seq_len=512, micro_batch=8, max_steps=500, lr=3e-4, warmup_steps=20, weight_decay=0.0,
                    eval_every=100, eval_windows=32, checkpoint_every=100)
CHUNK = 1024  # tokens whose logits (student and teacher, fp32) exist at once


@dataclass
class DistillTaskConfig:
    """Distillation's own flags; the loop's are LoopConfig's, with DISTILL_LOOP's defaults."""
    teacher: str  # an HF model directory (or hub id)
    student: str  # an HF model directory, or a shape / preset / config.json for a fresh student
    data: str  # a `brrr data build` directory made with the teacher's tokenizer, or a text file
    kind: str = "forward"  # forward | reverse KL
    temperature: float = 2.0
    alpha: float = 0.5  # weight of the hard-label cross-entropy; 1 - alpha on the KL
    teacher_top_k: int = 0  # > 0: only the teacher's k most likely tokens per position count
    export_dtype: str = "auto"  # auto: the student checkpoint's dtype, bfloat16 for a fresh student on CUDA

    def check(self):
        if self.kind not in KINDS:
            raise BrrrError(f"--kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not self.temperature > 0:
            raise BrrrError(f"--temperature must be > 0; got {self.temperature}")
        if not 0 <= self.alpha <= 1:
            raise BrrrError(f"--alpha must be in [0, 1] (the hard-label share of the loss); got {self.alpha}")
        if self.teacher_top_k < 0:
            raise BrrrError(f"--teacher-top-k must be >= 0 (0: the whole vocabulary); got {self.teacher_top_k}")
        if self.export_dtype not in ("auto", "float32", "bfloat16"):
            raise BrrrError(f"--export-dtype must be auto, float32 or bfloat16, got {self.export_dtype!r}")


@dataclass(init=False)
class DistillConfig:
    """`brrr distill`'s flags, composed: the loop's, the layout's and the task's. Built from flat flags:
    DistillConfig(teacher, student, data, out, alpha=..., max_steps=...)."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: DistillTaskConfig

    def __init__(self, teacher: str, student: str, data: str, out: str, **flags):
        self.task, self.loop, self.parallel = split_flags(flags, DistillTaskConfig(teacher, student, data),
                                                          LoopConfig(out, **DISTILL_LOOP), ParallelConfig())

    def make_task(self) -> "DistillTask":
        return DistillTask(self.task)


class DistillLoss(nn.Module):
    """The mixed loss of a [B, T] batch (inputs, targets); reduction "sum" returns (total, {"ce", "kl"} sums,
    tokens) for evaluation. The student's logits of each chunk are recomputed in backward, so one chunk's exist."""

    def __init__(self, student: nn.Module, teacher: nn.Module, cfg: DistillTaskConfig):
        super().__init__()
        self.student, self.cfg = student, cfg
        self.teacher = [teacher]  # a list: not a submodule (not trained, not checkpointed, not laid out)
        self.sums = {"ce": 0.0, "kl": 0.0, "tokens": 0}  # since the last log line (log_fields)

    def _chunk(self, hidden, teacher_logits, targets, kind, temperature):
        logits = self.student.compute_logits(hidden)
        ce = F.cross_entropy(logits.float(), targets, reduction="none")
        return ce, kd_loss(logits, teacher_logits, kind, temperature, self.cfg.teacher_top_k)

    def parts(self, inputs, targets, kind=None, temperature=None):
        """(per-token CE, per-token KL) of the batch, flattened."""
        kind, temperature = kind or self.cfg.kind, temperature or self.cfg.temperature
        b, t = inputs.shape
        meta, positions = AttnMeta.causal([t] * b, inputs.device), torch.arange(t, device=inputs.device).repeat(b)
        ids, targets = inputs.reshape(-1), targets.reshape(-1)
        teacher = self.teacher[0]
        with torch.no_grad():
            teacher_hidden = teacher(ids, positions, meta)
        hidden = self.student(ids, positions, meta)
        ces, kls = [], []
        for start in range(0, len(ids), CHUNK):
            rows = slice(start, start + CHUNK)
            with torch.no_grad():
                teacher_logits = teacher.compute_logits(teacher_hidden[rows])
            args = (hidden[rows], teacher_logits, targets[rows], kind, temperature)
            ce, kl = recompute(self._chunk, *args, use_reentrant=False) if torch.is_grad_enabled() \
                else self._chunk(*args)
            ces.append(ce)
            kls.append(kl)
        return torch.cat(ces), torch.cat(kls)

    def forward(self, inputs, targets):
        ce, kl = self.parts(inputs, targets)
        a = self.cfg.alpha
        self.sums["ce"] += ce.detach().sum()
        self.sums["kl"] += kl.detach().sum()
        self.sums["tokens"] += ce.numel()
        return a * ce.mean() + (1 - a) * kl.mean()


def distill_data(source: str, teacher_dir: Path, seq_len: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(train token ids, validation token ids, what identifies the data for --resume): a `brrr data build`
    directory's splits (its tokenizer must be the teacher's), or a text file tokenized with the teacher's tokenizer
    whose last tenth (at least one window) is held out."""
    tokenizer = Tokenizer.from_dir(teacher_dir)
    path = Path(source)
    if path.is_dir():
        data = TokenData(path)
        train, val = (load_tokens(path, tokenizer, split).numpy() for split in ("train", "val"))
        return train, val, data.manifest["tokenizer_sha256"]
    ids = load_tokens(path, tokenizer).numpy()
    held = max(seq_len + 1, len(ids) // 10)
    if len(ids) < held + seq_len + 1:
        raise BrrrError(f"--data {path}: {len(ids)} tokens, fewer than a training and a held-out window of "
                        f"--seq-len {seq_len} + 1")
    return ids[:-held], ids[-held:], hashlib.sha256(path.read_bytes()).hexdigest()


def mask_pruned_gradients(model: nn.Module) -> int:
    """For a pruned student: each projection's zero weights get a zero gradient, so AdamW (whose moments start at
    zero and whose weight decay scales the weight) leaves them at zero. Returns the weights held at zero."""
    held = 0
    for _, linear in projections(model):
        keep = (linear.weight != 0).to(linear.weight.dtype)
        held += int((keep == 0).sum())
        linear.weight.register_hook(lambda grad, keep=keep: grad * keep)
    return held


class DistillTask:
    """brrr distill (brrr/train/task.py's interface)."""
    command, run_name, parallel, eval_at_start = "distill", "distillation", True, True

    def __init__(self, cfg: DistillTaskConfig):
        self.cfg = cfg

    def configure(self, run) -> ModelConfig:
        cfg, loop, layout = self.cfg, run.cfg, run.parallel_cfg
        cfg.check()
        if layout.tp > 1 or layout.pp > 1:
            raise BrrrError("brrr distill lays the student out over data parallelism only (--dp-replicate, "
                            "--dp-shard); every rank holds the whole teacher. Pass --tp 1 --pp 1")
        self.teacher_dir = resolve_model(cfg.teacher)
        if quantization_config(self.teacher_dir) is not None:
            raise BrrrError(f"--teacher {self.teacher_dir} is quantized: distil from the floating-point teacher")
        self.teacher_cfg = ModelConfig.from_dir(self.teacher_dir)
        self.train_tokens, self.val_tokens, self.data_key = distill_data(cfg.data, self.teacher_dir, loop.seq_len)
        student = Path(cfg.student).expanduser()
        self.student_dir = student if (student / "model.safetensors").is_file() or \
            (student / "model.safetensors.index.json").is_file() else None
        if self.student_dir is not None:
            if quantization_config(student) is not None:
                raise BrrrError(f"--student {student} is quantized: distil into the floating-point model, then "
                                "quantize the student")
            self.model_cfg = ModelConfig.from_dir(student)
        else:
            t = self.teacher_cfg  # a fresh student takes the teacher's special tokens
            special = {"bos": t.bos_token_id, "eos": t.eos_token_ids[0], "im_end": t.eos_token_ids[-1]}
            self.model_cfg = resolve_config(cfg.student, t.vocab_size, special, loop.seq_len)
        if self.model_cfg.vocab_size != self.teacher_cfg.vocab_size:
            raise BrrrError(f"--student vocab_size {self.model_cfg.vocab_size} differs from the teacher's "
                            f"{self.teacher_cfg.vocab_size}: token-level distillation compares the two "
                            "distributions over one vocabulary")
        for name, c in (("teacher", self.teacher_cfg), ("student", self.model_cfg)):
            if loop.seq_len > c.max_context:
                raise BrrrError(f"--seq-len {loop.seq_len} exceeds the {name}'s context ({c.max_context} tokens)")
        self.sparse = self.student_dir is not None and \
            bool(json.loads((student / "config.json").read_text()).get("sparsity_config"))
        if self.sparse and (layout.dp_shard > 1 or (layout.dp_shard == -1 and run.ranks.world > layout.dp_replicate)):
            raise BrrrError("--student is pruned (sparsity_config): its zeros are kept by gradient masks, which "
                            "FSDP's sharded parameters do not carry; distil it on one process or with "
                            "--dp-replicate only")
        self.seq_len = loop.seq_len
        return self.model_cfg

    def build(self, run) -> nn.Module:
        loop = run.cfg
        dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
        self.teacher = load_model(self.teacher_dir, dtype=dtype, device=run.device)
        if self.student_dir is not None:  # fp32 master weights; autocast computes in bf16 on CUDA
            student = load_model(self.student_dir, dtype=torch.float32, device=run.device)
            student.requires_grad_(True).train()
        else:
            student = build_model(self.model_cfg, run.device, loop.seed)
        self.held_at_zero = mask_pruned_gradients(student) if self.sparse else 0
        self.model = self.checkpointed = run.parallelize(student)
        self.batches = TrainWindows(self.train_tokens, loop.seq_len, loop.micro_batch, loop.seed,
                                    run.mesh.dp_rank, run.mesh.dp_world)
        self.loss = self.loss_fn = DistillLoss(self.model, self.teacher, self.cfg)
        # model FLOPs per trained token: the student's forward and backward, and the teacher's forward
        self.flops_per_token = training_flops_per_token(self.model_cfg, loop.seq_len) + \
            training_flops_per_token(self.teacher_cfg, loop.seq_len) / 3
        return self.model

    def resume_key(self, run) -> dict:
        c, loop = self.cfg, run.cfg
        return {"teacher": str(self.teacher_dir.resolve()), "teacher_config": self.teacher_cfg.to_hf(),
                "student": c.student, "student_config": self.model_cfg.to_hf(), "kind": c.kind,
                "temperature": c.temperature, "alpha": c.alpha, "teacher_top_k": c.teacher_top_k,
                "data": self.data_key, "seq_len": loop.seq_len,
                "micro_batch": loop.micro_batch * run.mesh.dp_world, "grad_accum": loop.grad_accum,
                "seed": loop.seed}

    def describe(self, run) -> str:
        c, st = self.cfg, run.state
        n, t = param_counts(self.model_cfg)["total"], param_counts(self.teacher_cfg)["total"]
        held = f", {self.held_at_zero:,} pruned weights held at zero" if self.held_at_zero else ""
        return (f"distilling {self.teacher_dir} ({t / 1e6:.2f}M) into {c.student} ({n / 1e6:.2f}M){held} on "
                f"{run.device} ({run.gpu_name}): {c.kind} KL at T={c.temperature:g}, alpha {c.alpha:g} on the hard "
                f"labels{f', teacher top-{c.teacher_top_k}' if c.teacher_top_k else ''}; "
                f"{len(self.train_tokens):,} train tokens, {run.tokens_per_step:,} "
                f"tokens/step; steps {st['step']} -> {st['max_steps']}")

    def _val_rows(self, max_windows: int | None):
        return eval_windows(0, len(self.val_tokens), self.seq_len, max_windows)

    @torch.no_grad()
    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        """The student's next-token loss on the validation split and its forward KL to the teacher at T = 1."""
        self.model.eval()
        val, mb = self.val_tokens, run.cfg.micro_batch
        starts, length = self._val_rows(max_windows)
        ce = kl = 0.0
        n = 0
        for i in range(0, len(starts), mb):
            rows = torch.from_numpy(val[starts[i:i + mb, None] + np.arange(length)].astype(np.int64)).to(run.device)
            with run.autocast:
                c, k = self.loss.parts(rows[:, :-1], rows[:, 1:], kind="forward", temperature=1.0)
            ce, kl, n = ce + c.double().sum().item(), kl + k.double().sum().item(), n + c.numel()
        self.model.train()
        return {"val_loss": ce / n, "val_kl": kl / n} if n else {}

    def eval_line(self, val: dict) -> str:
        loss = val.get("val_loss", float("nan"))
        return f"val loss {loss:.4f} (ppl {math.exp(loss):.2f}) | KL to teacher {val.get('val_kl', float('nan')):.4f}"

    def eval_tokens(self, max_windows: int | None) -> int:
        starts, length = self._val_rows(max_windows)
        return len(starts) * length

    def predicted_memory(self, run) -> dict | None:
        return None

    def log_fields(self) -> dict:
        s = self.loss.sums
        if not s["tokens"]:
            return {}
        out = {"ce": float(s["ce"]) / s["tokens"], "kl": float(s["kl"]) / s["tokens"]}
        self.loss.sums = {"ce": 0.0, "kl": 0.0, "tokens": 0}
        return out

    def summary(self, run, final: dict) -> dict:
        return {"teacher": str(self.teacher_dir), "student": self.cfg.student,
                "params": param_counts(self.model_cfg)["total"], **final,
                **({"val_ppl": math.exp(final["val_loss"])} if "val_loss" in final else {})}

    def export(self, run) -> dict:
        """config.json + model.safetensors, and the teacher's tokenizer and generation files."""
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(self.cfg.export_dtype)
        if dtype is None:
            stored = self.model_cfg.torch_dtype if self.student_dir is not None else None
            dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(stored) or \
                (torch.bfloat16 if run.device.type == "cuda" else torch.float32)
        model = self.model
        if run.mesh.distributed and run.mesh.fsdp:  # rank 0 gathers the final checkpoint's shards
            model = build_model(self.model_cfg, "cpu")
            load_model_weights(model, run.checkpoints.path)
        save_model(model, run.out, dtype)
        if self.sparse:  # the pruned zeros were held: the output says so, with the measured fraction
            pruned = json.loads((self.student_dir / "config.json").read_text())["sparsity_config"]
            zeros = sum(int((m.weight == 0).sum()) for _, m in projections(model))
            pruned["global_sparsity"] = zeros / sum(m.weight.numel() for _, m in projections(model))
            hf = json.loads((run.out / "config.json").read_text())
            (run.out / "config.json").write_text(json.dumps({**hf, "sparsity_config": pruned}, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (self.teacher_dir / name).is_file():
                shutil.copy(self.teacher_dir / name, run.out / name)
        return {}
