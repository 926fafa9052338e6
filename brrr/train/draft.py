"""`brrr train-draft`: fit an EAGLE head (brrr/models/eagle.py) to a frozen target on a `brrr data build` directory.

Each window of tokens x_0 .. x_T runs through the frozen target once (no gradient): its features f_0 .. f_{T-1}
and, through its LM head, its next-token distributions p_1 .. p_T. The head reads (x_{j+1}, f_j) at positions
j = 0 .. T-2 and predicts f_{j+1}; EAGLE-1's loss on each position is
    smooth_l1(f'_{j+1}, f_{j+1}) + 0.1 * CE(p_{j+2}, softmax(lm_head(f'_{j+1})))
(feature regression, plus the cross-entropy of the head's token distribution against the target's: the target's
own predictions, not the data's next tokens, are what speculative decoding has to match).
It is a task of the training loop (brrr/train/trainer.py: warmup + cosine, AdamW, clipping, bf16 autocast on CUDA and
fp32 on CPU, logging, atomic checkpoints, exact --resume, --time-budget); only the head trains. Evaluation reports the
loss and the head's top-1 agreement with the target on the validation split: the acceptance rate of its first
greedy draft token. The output directory is the head (config.json + model.safetensors), which
`speculative_config={"method": "eagle", "model": OUT}` loads against the same target.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from brrr.analysis.spec_decode import eagle_training_flops_per_token
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.models.eagle import draft_logits, new_head, save_head, target_fingerprint
from brrr.token_data import TokenData
from brrr.train.config import DRAFT_LOOP, LoopConfig, ParallelConfig, split_flags
from brrr.train.sampler import TrainWindows, eval_windows

CE_WEIGHT = 0.1  # EAGLE-1's weight on the token loss, next to 1.0 on the feature regression
ACCEPTANCE_K = 8  # draft tokens per step when measuring acceptance: per-position rates for calc spec's k = 1..8
ACCEPTANCE_PROMPTS, ACCEPTANCE_STEPS = 16, 16  # held-out prompts, and verify steps on each


@dataclass
class DraftTaskConfig:
    """The draft head's own flags: the frozen target's HF model directory and the data (the loop's are LoopConfig's,
    with DRAFT_LOOP's defaults for a one-layer head)."""
    model: str
    data: str


@dataclass(init=False)
class DraftConfig:
    """`brrr train-draft`'s flags, composed: the loop's and the task's; one process. Built from flat flags:
    DraftConfig(target, data, out, seq_len=..., max_steps=...)."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: DraftTaskConfig

    def __init__(self, model: str, data: str, out: str, **flags):
        self.task, self.loop = split_flags(flags, DraftTaskConfig(model, data), LoopConfig(out, **DRAFT_LOOP))
        self.parallel = ParallelConfig()

    def make_task(self) -> "DraftTask":
        return DraftTask(self.task)


class EagleLoss(nn.Module):
    """EAGLE-1's loss of the head over [B, T] windows of a frozen target (module: the head; the target is held
    outside it, so only the head's parameters are the module's)."""

    def __init__(self, head: nn.Module, target: nn.Module):
        super().__init__()
        self.head = head
        self.target = [target]  # a list: not a submodule (not trained, not checkpointed)
        self._meta: dict = {}

    def _metas(self, batch: int, t: int, device):
        key = (batch, t, str(device))
        if key not in self._meta:
            self._meta[key] = (AttnMeta.causal([t] * batch, device), torch.arange(t, device=device).repeat(batch),
                               AttnMeta.causal([t - 1] * batch, device),
                               torch.arange(t - 1, device=device).repeat(batch))
        return self._meta[key]

    def parts(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-position smooth L1, cross-entropy and top-1 agreement (the head's argmax is the target's), each
        [B * (T - 1)]."""
        target = self.target[0]
        b, t = inputs.shape
        if t < 2:
            raise BrrrError(f"--seq-len {t} is too short: a window needs 2 tokens for the head to predict one")
        meta, positions, head_meta, head_positions = self._metas(b, t, inputs.device)
        with torch.no_grad():
            feats = target(inputs.reshape(-1), positions, meta).view(b, t, -1)
            labels = feats[:, 1:].reshape(b * (t - 1), -1)
            p = torch.softmax(target.compute_logits(labels), dim=-1)
            embeds = target.model.embed_tokens(targets[:, :-1].reshape(-1))
        pred = self.head(embeds, feats[:, :-1].reshape(b * (t - 1), -1), head_positions, head_meta)
        logq = torch.log_softmax(draft_logits(target, pred), dim=-1)
        return {"smooth_l1": F.smooth_l1_loss(pred.float(), labels.float(), reduction="none").mean(-1),
                "ce": -(p * logq).sum(-1), "top1": (logq.argmax(-1) == p.argmax(-1)).float()}

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        parts = self.parts(inputs, targets)
        return parts["smooth_l1"].mean() + CE_WEIGHT * parts["ce"].mean()


class DraftTask:
    """brrr train-draft (brrr/train/task.py's interface): the head trains on EagleLoss against the frozen target;
    evaluation adds the head's top-1 agreement with the target, the export a greedy acceptance measurement."""
    command, run_name, parallel, eval_at_start = "train-draft", "train-draft", False, True

    def __init__(self, cfg: DraftTaskConfig):
        self.cfg = cfg

    def configure(self, run) -> ModelConfig:
        self.target_dir = Path(self.cfg.model)
        if not (self.target_dir / "config.json").is_file():
            raise BrrrError(f"--target {self.target_dir}: not a model directory (no config.json)")
        self.data = TokenData(self.cfg.data)
        _check_tokenizer(self.target_dir, self.data)
        model_cfg = ModelConfig.from_dir(self.target_dir)
        if self.data.vocab_size > model_cfg.vocab_size:
            raise BrrrError(f"--data vocabulary ({self.data.vocab_size}) is larger than the target's vocab_size "
                            f"({model_cfg.vocab_size}): the data was not built for this target")
        if run.cfg.seq_len > model_cfg.max_context:
            raise BrrrError(f"--seq-len {run.cfg.seq_len} exceeds the target's context ({model_cfg.max_context})")
        self.seq_len = run.cfg.seq_len
        return model_cfg

    def build(self, run) -> nn.Module:
        loop = run.cfg
        dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
        self.target = load_model(self.target_dir, dtype=dtype, device=run.device)
        self.model_cfg = self.target.config
        # fp32 master weights; autocast runs the head in bf16 on CUDA
        self.model = self.checkpointed = new_head(self.target, loop.seed)
        self.batches = TrainWindows(self.data.splits["train"], loop.seq_len, loop.micro_batch, loop.seed)
        self.loss = self.loss_fn = EagleLoss(self.model, self.target)
        self.flops_per_token = eagle_training_flops_per_token(self.model_cfg, loop.seq_len)
        return self.model

    def resume_key(self, run) -> dict:
        c = run.cfg
        return {"target": target_fingerprint(self.target), "tokenizer_sha256": self.data.manifest["tokenizer_sha256"],
                "seq_len": c.seq_len, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "seed": c.seed}

    def describe(self, run) -> str:
        n, st = sum(p.numel() for p in run.params), run.state
        return (f"training an EAGLE head for {self.cfg.model}: {n / 1e6:.2f}M parameters on {run.device} "
                f"({run.gpu_name}); {self.data.manifest['splits']['train']['tokens']:,} train tokens, "
                f"{run.tokens_per_step:,} tokens/step; steps {st['step']} -> {st['max_steps']}")

    def _val_rows(self, max_windows: int | None):
        for start, end in self.data.source_ranges("val").values():
            yield eval_windows(start, end, self.seq_len, max_windows)

    @torch.no_grad()
    def evaluate(self, run, max_windows: int | None) -> dict[str, float]:
        """Mean loss, its parts, and top-1 agreement with the target over validation windows."""
        self.model.eval()
        val, mb = self.data.splits["val"], run.cfg.micro_batch
        sums = {"smooth_l1": 0.0, "ce": 0.0, "top1": 0.0}
        count = 0
        for starts, length in self._val_rows(max_windows):
            if length < 3:
                continue
            for i in range(0, len(starts), mb):
                chunk = starts[i: i + mb]
                rows = torch.from_numpy(val[chunk[:, None] + np.arange(length)].astype(np.int64)).to(run.device)
                with run.autocast:
                    parts = self.loss.parts(rows[:, :-1], rows[:, 1:])
                for k in sums:
                    sums[k] += parts[k].double().sum().item()
                count += parts["top1"].numel()
        self.model.train()
        if not count:
            return {}
        out = {f"val_{k}": v / count for k, v in sums.items()}
        out["val_loss"] = out["val_smooth_l1"] + CE_WEIGHT * out["val_ce"]
        return out

    def eval_line(self, val: dict) -> str:
        if not val:
            return "the validation split is empty"
        return (f"loss {val['val_loss']:.4f} (smooth L1 {val['val_smooth_l1']:.4f}, CE {val['val_ce']:.4f}) | "
                f"top-1 agreement with the target {val['val_top1']:.1%}")

    def eval_tokens(self, max_windows: int | None) -> int:
        return sum(len(starts) * length for starts, length in self._val_rows(max_windows))

    def predicted_memory(self, run) -> None:
        return None

    def log_fields(self) -> dict:
        return {}

    def _acceptance_prompts(self) -> list[list[int]]:
        """Up to ACCEPTANCE_PROMPTS held-out prompts of half a window each, spread over the validation split."""
        val = self.data.splits["val"]
        length = min(self.seq_len, self.model_cfg.max_context) // 2
        if length < 2 or len(val) < length:
            return []
        starts = np.linspace(0, len(val) - length, ACCEPTANCE_PROMPTS).astype(np.int64)
        return [val[s:s + length].astype(np.int64).tolist() for s in np.unique(starts)]

    def summary(self, run, final: dict) -> dict:
        return {"target": self.cfg.model, "head_params": sum(p.numel() for p in run.params)}

    def export(self, run) -> dict:
        """The head, then (which --time-budget does not size: a cut-short run keeps its head) greedy speculative
        decoding of held-out prompts with it."""
        save_head(self.model, run.out, torch.bfloat16 if run.device.type == "cuda" else torch.float32)
        self.model.eval()
        prompts = self._acceptance_prompts()
        room = self.model_cfg.max_context - max(map(len, prompts), default=0)
        acceptance = measure_acceptance(self.target, self.model, prompts,
                                        steps=min(ACCEPTANCE_STEPS, room // (ACCEPTANCE_K + 1)))
        run.log({"step": run.state["step"], "acceptance": acceptance},
                f"greedy speculative decoding of held-out text, k={acceptance['k']}: mean accepted length "
                f"{acceptance['mean_acceptance_length'] or 0:.2f}, acceptance per position "
                + " ".join(f"{r:.2f}" for r in acceptance["acceptance_per_position"]))
        return {"acceptance": acceptance}



def _check_tokenizer(target_dir: Path, data: TokenData) -> None:
    """The data must be tokenized by the target's tokenizer (when the target ships one)."""
    file = target_dir / "tokenizer.json"
    if file.is_file() and hashlib.sha256(file.read_bytes()).hexdigest() != data.manifest["tokenizer_sha256"]:
        raise BrrrError(f"--data {data.path} was tokenized with another tokenizer than the target's ({file}): "
                        "the head must see the target's own tokens; build the data with the target's tokenizer")


@torch.no_grad()
def measure_acceptance(target: nn.Module, head: nn.Module, prompts: list[list[int]], k: int = ACCEPTANCE_K,
                       steps: int = ACCEPTANCE_STEPS) -> dict:
    """Greedy speculative decoding of each prompt for `steps` verify steps, the target recomputing every sequence
    whole (no engine): the head drafts k tokens, the target's greedy tokens accept the longest matching prefix and
    add one of their own. Returns vLLM's figures: acceptance per position (accepted at position i / drafts) and
    the mean acceptance length (1 + accepted / drafts)."""
    from brrr.engine.spec.eagle import EagleProposer
    from brrr.engine.spec.proposer import SpecInput

    if not prompts or steps < 1:
        return {"k": k, "drafts": 0, "acceptance_per_position": [], "mean_acceptance_length": None}
    device = target.model.embed_tokens.weight.device
    proposer = EagleProposer(head, target)
    seqs = [list(p) for p in prompts]
    hidden = [_features(target, [s], device)[0][:-1] for s in seqs]
    accepted_at = [0] * k
    for _ in range(steps):
        drafts = proposer.propose([SpecInput(i, s, h) for i, (s, h) in enumerate(zip(seqs, hidden))], k)
        feats = _features(target, [s + d for s, d in zip(seqs, drafts)], device)
        for i, (s, d, f) in enumerate(zip(seqs, drafts, feats)):
            n = len(s)
            greedy = target.compute_logits(f[n - 1:]).argmax(-1).tolist()  # the target's token after each prefix
            a = 0
            while a < len(d) and d[a] == greedy[a]:
                accepted_at[a] += 1
                a += 1
            s.extend(d[:a] + [greedy[a]])
            hidden[i] = f[n - 1:n + a]  # features of the positions now committed, through the new last-but-one
    drafts_made = steps * len(seqs)
    return {"k": k, "drafts": drafts_made, "acceptance_per_position": [a / drafts_made for a in accepted_at],
            "mean_acceptance_length": 1 + sum(accepted_at) / drafts_made}


def _features(target: nn.Module, seqs: list[list[int]], device) -> list[torch.Tensor]:
    """The target's final hidden states for every position of each sequence (one varlen forward)."""
    lengths = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    return list(target(ids, positions, AttnMeta.causal(lengths, device)).split(lengths))
