"""`brrr grpo`: Group Relative Policy Optimization with TRL's names and defaults, a task of the one training loop,
rolling out through brrr's engine in the same process (brrr/train/rollout.py), which shares the trainer's weight
tensors (or, for fp32 master weights on CUDA, holds a bf16 serving copy that each step's sync overwrites in place).

One optimizer step: the step's prompts (micro_batch x grad_accum completions / num_generations of them per rank) go
to the engine as one request each with n = num_generations, seeded by (seed, global prompt counter, generation) so a
run (and --resume, and any number of ranks) draws the same completions; the reward functions score them (brrr/train/rewards.py) and the group advantages follow
(brrr/train/grpo_loss.py); with beta != 0 the reference scores them too (the base with the adapters off, or a
frozen copy of a full-parameter policy); the engine sleeps (its KV cache freed) and the loop runs the micro-batches
through the GRPO loss; at the next step the engine wakes and sees the new weights, which it shares with the
trainer. The first micro-batch forward is the "old policy" of TRL's num_iterations = 1: the ratio is 1 in value,
and the same forward measures the engine-vs-trainer mismatch |logp_engine - logp_trainer| (max and mean) and gives
the truncated importance weights. Every log line carries the phase times of its step (weight_sync_s and wake_s
before its rollout, rollout_s, reference_logps_s, train_s: its micro-batches and optimizer step), the mismatch, and
TRL's metrics (reward, reward_std, rewards/NAME/mean, frac_reward_zero_std, completions/mean_length, clip_ratio/*,
kl).

Under torchrun (DDP, data parallelism only: check_layout) every rank holds the whole policy and its own colocated
engine, and rolls out its block of whole groups of the step's prompts (RolloutBatches); the rewards are gathered so
the advantages, dapo's token count and the logged statistics are the whole step's, and DDP averages the gradients:
the step is the one-process step over all the ranks' prompts (tests/train/test_grpo_distributed.py).

--batch-invariant: the engine samples in the batch-invariant mode (docs/batch-invariance.md) and the trainer's
log-prob forwards (the policy's and the reference's) run in it too, outside autocast as the engine does, so at
temperature 1 with no top-p / top-k the first micro-batch's log-probs are the engine's bit for bit (mismatch 0).
A full-parameter policy on CUDA then rolls out from its fp32 weights themselves, not a bf16 copy.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from brrr.analysis.model import param_counts
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.hub import resolve_model
from brrr.kernels.batch_invariant import batch_invariant
from brrr.pretrained import stop_token_ids
from brrr.sampling_params import SamplingParams
from brrr.tokenizer import Tokenizer
from brrr.train.completion_batch import completion_logprobs, completion_mask, padded
from brrr.train.config import LoopConfig, ParallelConfig, split_flags
from brrr.train.grpo_loss import IS_MODES, LOSS_TYPES, SCALE_REWARDS, group_advantages, grpo_loss, \
    importance_weights, nanstd
from brrr.train.policy import Policy, PolicyConfig
from brrr.train.rewards import Rewards
from brrr.train.rollout import ColocatedRollout
from brrr.train.sft import read_jsonl
from brrr.train.task import NoHeldOut

# TRL's GRPOConfig defaults where the loop has the knob (learning_rate 1e-6, batch 8 completions, no decay)
GRPO_LOOP = dict(seq_len=None, micro_batch=8, grad_accum=1, max_steps=500, lr=1e-6, min_lr_ratio=0.0,
                 warmup_steps=0, weight_decay=0.0, beta2=0.999, eval_every=100, log_every=1, checkpoint_every=100)


@dataclass
class GRPOTaskConfig(PolicyConfig):
    """GRPO's own flags (TRL's GRPOConfig names and defaults) and the policy's."""
    model: str | None = None
    prompts: str = ""
    reward: list = field(default_factory=list)  # MODULE:FUNCTION specs or built-in names (brrr/train/rewards.py)
    reward_weights: list | None = None
    num_generations: int = 8
    max_completion_length: int = 512
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    importance_sampling_correction: bool = True
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_clip_max: float = 3.0
    batch_invariant: bool = False  # engine and trainer in the batch-invariant mode (vLLM's --batch-invariant)

    def check(self, loop: LoopConfig):
        for name, value, allowed in (("loss_type", self.loss_type, LOSS_TYPES),
                                     ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("importance_sampling_mode", self.importance_sampling_mode, IS_MODES)):
            if value not in allowed:
                raise BrrrError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; got {value!r}")
        if self.num_generations < 2:
            raise BrrrError(f"--num-generations must be >= 2 (advantages compare the samples of a group), got "
                            f"{self.num_generations}")
        per_step = loop.micro_batch * loop.grad_accum
        if per_step % self.num_generations:
            raise BrrrError(f"--per-device-train-batch-size x --gradient-accumulation-steps ({per_step} completions "
                            f"a step) must be a multiple of --num-generations ({self.num_generations})")
        if self.max_completion_length < 1 or self.beta < 0 or self.epsilon <= 0:
            raise BrrrError("--max-completion-length must be >= 1, --beta >= 0 and --epsilon > 0")
        if self.temperature <= 0:
            raise BrrrError(f"--temperature must be > 0 (GRPO samples), got {self.temperature}")
        if self.batch_invariant and self.qlora:
            raise BrrrError("--batch-invariant does not combine with --qlora: NF4 projections have no "
                            "batch-invariant form")
        if self.batch_invariant and self.peft and self.lora_dropout != 0:
            raise BrrrError(f"--batch-invariant needs --lora-dropout 0 (got {self.lora_dropout}): the trainer's "
                            f"forward drops adapter inputs the engine's does not, so their log-probs cannot agree")


@dataclass(init=False)
class GRPOConfig:
    """`brrr grpo`'s flags, composed: the loop's (GRPO_LOOP's defaults), the layout's (under torchrun: data
    parallelism, DDP, the only one it takes: check_layout) and the task's."""
    loop: LoopConfig
    parallel: ParallelConfig
    task: GRPOTaskConfig

    def __init__(self, model: str | None, prompts: str, out: str, **flags):
        self.task, self.loop, self.parallel = split_flags(flags, GRPOTaskConfig(model=model, prompts=prompts),
                                                          LoopConfig(out, **GRPO_LOOP), ParallelConfig())

    def make_task(self) -> "GRPOTask":
        return GRPOTask(self.task)


def check_layout(layout: ParallelConfig, world: int) -> None:
    """GRPO under torchrun replicates the policy on every rank (DDP): each rank's colocated engine serves the whole
    weights, which FSDP's shards, TP's slices and PP's stages are not. The default layout (--dp-shard -1: every
    rank left over) becomes --dp-replicate WORLD_SIZE; anything else but replicas is refused by its flag."""
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(layout, name) != 1:
            raise BrrrError(f"brrr grpo runs data parallelism only (DDP: each rank's rollout engine serves the whole "
                            f"weights); --{name} {getattr(layout, name)} is not supported, pass --{name} 1")
    if layout.dp_shard not in (-1, 1):
        raise BrrrError(f"brrr grpo replicates the weights over the ranks (DDP: each rank's rollout engine serves "
                        f"them whole), so FSDP's --dp-shard {layout.dp_shard} is not supported: leave --dp-shard "
                        f"at -1")
    if layout.dp_replicate not in (1, world):
        raise BrrrError(f"--dp-replicate {layout.dp_replicate} must be the world size {world} (WORLD_SIZE): brrr "
                        f"grpo replicates the weights on every rank")
    layout.dp_replicate, layout.dp_shard = world, 1


def load_prompts(path, tokenizer) -> tuple[list[dict], list[list[int]], list[int]]:
    """(rows, prompt token ids, line numbers): "prompt" is text (encoded with the special tokens) or chat messages
    (rendered with the generation prompt); the other fields go to the reward functions."""
    rows, ids, lines = [], [], []
    for lineno, row in read_jsonl(path):
        prompt = row.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids.append(tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids.append(tokenizer.encode_chat(prompt, add_generation_prompt=True))
        else:
            raise BrrrError(f"{path}, line {lineno}: \"prompt\" must be a non-empty string or a list of chat "
                            f"messages; got {type(prompt).__name__}")
        rows.append(row)
        lines.append(lineno)
    return rows, ids, lines


class RolloutBatches:
    """The loop's batches: the first micro-batch of every step runs that step's rollout; each micro-batch is a
    slice of its completions. Under data parallelism a step's prompts are those of all dp ranks together (the
    global prompt counter k runs over them), and each rank rolls out a contiguous block of whole groups: rank r
    the step's prompts [r x P, (r + 1) x P), P = micro_batch x grad_accum / num_generations, so the ranks'
    shares are disjoint and their union is what one process with dp_world times the batch rolls out."""

    def __init__(self, task: "GRPOTask", micro_batch: int, grad_accum: int, dp_rank: int = 0, dp_world: int = 1):
        self.task, self.micro_batch, self.grad_accum = task, micro_batch, grad_accum
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.prompts_per_step = micro_batch * grad_accum // task.cfg.num_generations  # this rank's
        self.global_prompts_per_step = self.prompts_per_step * dp_world
        self._step, self._data = -1, None

    def epoch(self, position: int) -> float:
        return position // self.grad_accum * self.global_prompts_per_step / len(self.task.prompt_ids)

    def prompt_counters(self, step: int) -> list[int]:
        """The global prompt counters k of this rank's share of the step (the data order's positions)."""
        first = step * self.global_prompts_per_step + self.dp_rank * self.prompts_per_step
        return list(range(first, first + self.prompts_per_step))

    def prompt_index(self, k: int) -> int:
        """The prompt at global counter k: epochs of seeded permutations of the prompt file."""
        n = len(self.task.prompt_ids)
        return int(np.random.default_rng([self.task.seed, k // n]).permutation(n)[k % n])

    def prompt_indices(self, step: int) -> list[int]:
        return [self.prompt_index(k) for k in self.prompt_counters(step)]

    def batch_at(self, position: int, device):
        step, i = divmod(position, self.grad_accum)
        if step != self._step:
            self._step, self._data = step, self.task.rollout(step, self.prompt_counters(step), device)
        d, mb = self._data, self.micro_batch
        part = slice(i * mb, (i + 1) * mb)
        ref = None if d["ref"] is None else d["ref"][part]
        return (d["prompts"][part], d["completions"][part], d["advantages"][part], ref, d["engine_logps"][part],
                d["num_items"])


class GRPOLoss(nn.Module):
    def __init__(self, task: "GRPOTask"):
        super().__init__()
        self.task = task
        self.metrics: dict[str, list] = {}

    def forward(self, prompts, completions, advantages, ref_logps, engine_logps, num_items):
        t, cfg = self.task, self.task.cfg
        device = advantages.device
        with t.scoring(device):
            logps = completion_logprobs(t.model, prompts, completions, device, cfg.temperature)
        mask = completion_mask([len(c) for c in completions], device)
        with torch.no_grad():  # the trainer's scoring of the engine's tokens, before this step's update
            delta = torch.nan_to_num((logps.detach() - engine_logps).abs() * mask)  # NaN: no engine logprob
            self.metrics.setdefault("logprob_mismatch/max", []).append(delta.max())
            self.metrics.setdefault("logprob_mismatch/mean", []).append(delta.sum() / mask.sum().clamp(min=1))
        weights = None
        if cfg.importance_sampling_correction and t.engine_logps_comparable:
            weights = importance_weights(logps.detach(), engine_logps, mask, cfg.importance_sampling_mode,
                                         cfg.importance_sampling_clip_max)
            self.metrics.setdefault("sampling/importance_sampling_ratio/mean", []).append(
                (weights * mask).sum() / mask.sum() if weights.shape == mask.shape else weights.mean())
        loss, metrics = grpo_loss(logps, None, ref_logps, advantages, mask, loss_type=cfg.loss_type, beta=cfg.beta,
                                  epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                                  max_completion_length=cfg.max_completion_length, num_items=num_items,
                                  is_weights=weights)
        for k, v in metrics.items():
            self.metrics.setdefault(k, []).append(v)
        return loss


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class GRPOTask(NoHeldOut):
    """brrr grpo (brrr/train/task.py's interface)."""
    command, run_name, parallel, eval_at_start = "grpo", "GRPO", True, False
    flops_per_token = 0.0

    def __init__(self, cfg: GRPOTaskConfig, rewards: Rewards | None = None):
        """rewards: reward functions given as objects (tests); else cfg.reward's specs are loaded."""
        self.cfg, self._rewards = cfg, rewards
        self.phase: dict[str, float] = {}
        self.stats: dict[str, list] = {}

    def configure(self, run) -> ModelConfig:
        cfg, loop = self.cfg, run.cfg
        cfg.check(loop)
        check_layout(run.parallel_cfg, run.ranks.world)
        self.ranks = run.ranks
        self.seed = loop.seed
        self.model_path = resolve_model(cfg.model)
        self.base_name = cfg.model if cfg.model and not Path(cfg.model).is_dir() else str(self.model_path.resolve())
        model_cfg = ModelConfig.from_dir(self.model_path)
        cfg.torch_dtype(run.device)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.rewards = self._rewards or Rewards(cfg.reward, cfg.reward_weights, self.tokenizer)
        self.rewards.tokenizer = self.tokenizer
        self.rows, self.prompt_ids, self.lines = load_prompts(cfg.prompts, self.tokenizer)
        longest = max(map(len, self.prompt_ids))
        if longest + cfg.max_completion_length > model_cfg.max_context:
            at = self.lines[max(range(len(self.prompt_ids)), key=lambda i: len(self.prompt_ids[i]))]
            raise BrrrError(f"{cfg.prompts}, line {at}: a prompt of {longest} tokens plus --max-completion-length "
                            f"{cfg.max_completion_length} exceeds the model's context ({model_cfg.max_context})")
        loop.seq_len = longest + cfg.max_completion_length  # the step's tokens are counted at this bound
        self.max_model_len = loop.seq_len
        # the engine reports raw log-probs (softmax of the logits): the sampling distribution's only at T = 1
        # with no top-p / top-k filter, so only then are they compared with (and importance-weight) the trainer's
        self.engine_logps_comparable = cfg.temperature == 1.0 and cfg.top_p == 1.0 and cfg.top_k == 0
        return model_cfg

    def build(self, run) -> nn.Module:
        torch.manual_seed(run.cfg.seed)
        self.policy = Policy(self.cfg, self.model_path, self.base_name, run.device)
        self.model = self.policy.model
        self.model_cfg = self.model.config
        self.model_device = next(self.model.parameters()).device
        self.frozen_ref = None
        if self.cfg.beta != 0 and not self.policy.reference_is_live:  # full-parameter: a frozen copy, as TRL
            self.frozen_ref = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.checkpointed = self.policy.checkpointed
        self.batches = RolloutBatches(self, run.cfg.micro_batch, run.cfg.grad_accum, run.mesh.dp_rank,
                                      run.mesh.dp_world)
        self.loss = self.loss_fn = GRPOLoss(self)
        self.flops_per_token = (6 if not self.policy.lora else 4) * param_counts(self.model_cfg)["total"]
        eos = stop_token_ids(self.model_path, self.model_cfg, self.tokenizer)
        # fp32 master weights on CUDA roll out from a bf16 serving copy (packed projections), synced by copying;
        # adapters over a bf16 base, anything on the CPU, and any policy in the batch-invariant mode (whose engine
        # runs the trainer's weights in their own dtype) share the trainer's tensors
        copy_dtype = torch.bfloat16 if run.device.type == "cuda" and not self.policy.lora \
            and not self.cfg.batch_invariant else None
        self.engine = ColocatedRollout(self.model, self.tokenizer, eos, self.max_model_len,
                                       max(8, self.batches.prompts_per_step * self.cfg.num_generations), copy_dtype,
                                       batch_invariant=self.cfg.batch_invariant)
        self.kv_bytes = self.engine.kv_cache_bytes()
        self._train_start = None
        # under torchrun: DDP (the layout's data parallelism: gradients averaged over the ranks in backward), laid
        # on after the deep copies above (DDP takes none); the engine keeps the same module and tensors
        self.model = run.parallelize(self.model)
        if run.mesh.dp_world > 1:
            # DDP builds its gradient buckets at the model's first forward; the engine's runs in inference mode,
            # which would make them inference tensors that backward cannot write into: one forward here first
            with torch.no_grad():
                completion_logprobs(self.model, [self.prompt_ids[0]], [[0]], run.device)
        return self.model

    def scoring(self, device):
        """The context of the trainer's log-prob forwards: with --batch-invariant the mode, outside autocast (the
        engine runs the weights in their own dtype), so they run the engine's ops; else nothing."""
        if not self.cfg.batch_invariant:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(torch.device(device).type, enabled=False))
        stack.enter_context(batch_invariant())
        return stack

    # -- one step's data -------------------------------------------------------------------------------------
    def rollout(self, step: int, counters: list[int], device) -> dict:
        """This rank's share of the step: counters are the global prompt counters of its prompts
        (RolloutBatches.prompt_counters)."""
        cfg, ph = self.cfg, self.phase
        indices = [self.batches.prompt_index(k) for k in counters]
        ph.clear()  # this step's phases only
        if self.engine.asleep:
            ph["weight_sync_s"] = self.engine.sync_weights()
            start = time.perf_counter()
            self.engine.wake()
            ph["wake_s"] = time.perf_counter() - start
        start = time.perf_counter()
        # the engine seeds sample i of a request by seed + i: keyed by (run seed, global prompt counter k,
        # generation i), a completion is the same whichever rank, and however many ranks, roll it out
        params = [SamplingParams(n=cfg.num_generations, max_tokens=cfg.max_completion_length,
                                 temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, logprobs=0,
                                 seed=(self.seed * 1_000_003 + k * cfg.num_generations) % 2**62)
                  for k in counters]
        results = self.engine.generate([self.prompt_ids[i] for i in indices], params)
        ph["rollout_s"] = time.perf_counter() - start
        prompts, completions, texts, rows, lines, prompt_objs, engine_lp = [], [], [], [], [], [], []
        for i, res in zip(indices, results):
            for sample in sorted(res.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids) or [self.tokenizer.eos_token_id or 0]
                prompts.append(self.prompt_ids[i])
                completions.append(ids)
                chat = isinstance(self.rows[i]["prompt"], list)  # TRL hands chat completions as messages
                texts.append([{"role": "assistant", "content": sample.text}] if chat else sample.text)
                rows.append(self.rows[i])
                lines.append(self.lines[i])
                prompt_objs.append(self.rows[i]["prompt"])
                lp = [next(iter(e.values())) if e else math.nan for e in (sample.logprobs or [])]
                engine_lp.append(torch.tensor((lp + [math.nan] * len(ids))[:len(ids)], dtype=torch.float32))
        per_fn, rewards = self.rewards(prompt_objs, texts, completions, rows, lines)
        lengths = [len(c) for c in completions]
        # every rank's rewards and lengths, in rank order (the step's global order), as TRL gathers them: the
        # advantages (--scale-rewards batch: the std of the whole step's), the logged statistics and dapo's token
        # count are one process's over the whole step; this rank keeps its slice
        all_per_fn, all_rewards, all_lengths = self._gathered(per_fn, rewards, lengths)
        advantages, std = group_advantages(all_rewards, cfg.num_generations, cfg.scale_rewards)
        self._reward_stats(all_per_fn, all_rewards, std, all_lengths)
        mine = slice(self.batches.dp_rank * len(rewards), (self.batches.dp_rank + 1) * len(rewards))
        advantages = advantages[mine]
        ref = None
        start = time.perf_counter()
        if cfg.beta != 0:
            ref = self.reference_logps(prompts, completions, device)
        ph["reference_logps_s"] = time.perf_counter() - start
        self.kv_freed = self.engine.sleep()
        self._train_start = time.perf_counter()
        # dapo divides by the step's completion tokens over every rank: per micro-batch, as DDP then averages
        # over the ranks, that total / (grad_accum x dp ranks)
        return {"prompts": prompts, "completions": completions, "advantages": advantages.to(device), "ref": ref,
                "engine_logps": padded(torch.cat(engine_lp), lengths).to(device),
                "num_items": float(sum(all_lengths)) / (self.batches.grad_accum * self.batches.dp_world)}

    def _gathered(self, per_fn: torch.Tensor, rewards: torch.Tensor, lengths: list[int]):
        """(per_fn, rewards, lengths) of every dp rank concatenated in rank order (this rank's alone in one
        process); over the ranks' gloo group (CPU tensors), in float64, which holds float32 rewards exactly."""
        if self.batches.dp_world == 1:
            return per_fn, rewards, lengths
        n, f = per_fn.shape
        mine = tuple(torch.cat([per_fn.reshape(-1), rewards, torch.tensor(lengths, dtype=rewards.dtype)]).tolist())
        rows = torch.tensor(self.ranks.gather(mine), dtype=torch.float64)
        per_fn_all = rows[:, :n * f].reshape(-1, f).to(per_fn.dtype)
        rewards_all = rows[:, n * f:n * f + n].reshape(-1).to(rewards.dtype)
        return per_fn_all, rewards_all, [int(x) for x in rows[:, n * f + n:].reshape(-1).tolist()]

    @torch.no_grad()
    def reference_logps(self, prompts, completions, device) -> torch.Tensor:
        model = self.frozen_ref if self.frozen_ref is not None else self.model
        was = self.model.training
        self.model.eval()
        out = []
        mb = self.batches.micro_batch
        with self.policy.reference() if self.frozen_ref is None else torch.no_grad(), self.scoring(device):
            for s in range(0, len(prompts), mb):
                out.append(completion_logprobs(model, prompts[s:s + mb], completions[s:s + mb], device,
                                               self.cfg.temperature))
        self.model.train(was)
        width = max(t.shape[1] for t in out)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in out])

    def _reward_stats(self, per_fn, rewards, std, lengths):
        s = self.stats
        s.setdefault("reward", []).append(torch.nanmean(rewards).item())
        s.setdefault("reward_std", []).append(nanstd(rewards).item())
        s.setdefault("frac_reward_zero_std", []).append(torch.isclose(std, torch.zeros_like(std)).float().mean()
                                                        .item())
        s.setdefault("completions/mean_length", []).append(float(np.mean(lengths)))
        for j, name in enumerate(self.rewards.names):
            s.setdefault(f"rewards/{name}/mean", []).append(torch.nanmean(per_fn[:, j]).item())

    # -- the loop's interface ----------------------------------------------------------------------------------
    def resume_key(self, run) -> dict:
        c, loop = self.cfg, run.cfg
        return {"model": self.base_name, "prompts_sha256": _sha256(c.prompts), "reward": list(c.reward) or
                self.rewards.names, "num_generations": c.num_generations,
                "max_completion_length": c.max_completion_length, "beta": c.beta, "loss_type": c.loss_type,
                "peft": c.peft, "micro_batch": loop.micro_batch * self.batches.dp_world,
                "grad_accum": loop.grad_accum, "seed": loop.seed}

    def describe(self, run) -> str:
        c, st = self.cfg, run.state
        b = self.batches
        ranks = f" on each of {b.dp_world} DDP ranks ({b.prompts_per_step} prompts each)" if b.dp_world > 1 else ""
        return (f"GRPO ({c.loss_type}, beta {c.beta}, {c.num_generations} generations x "
                f"{b.global_prompts_per_step} prompts a step, up to {c.max_completion_length} tokens) of "
                f"{self.policy.describe()} on {run.device}, rollouts by brrr's engine in this process{ranks}"
                f"{' in the batch-invariant mode' if c.batch_invariant else ''} over "
                f"{'the same tensors' if self.engine.shared else 'a bf16 copy synced in place'} (KV cache "
                f"{self.kv_bytes / 2**20:.1f} MiB, freed for each train step); "
                f"{len(self.prompt_ids)} prompts; rewards {' + '.join(self.rewards.names)}; "
                f"steps {st['step']} -> {st['max_steps']}")

    def eval_line(self, val: dict) -> str:
        return "no held-out evaluation (the reward is logged each step)"

    def log_fields(self) -> dict:
        """The step's metrics; called after its optimizer step, which ends its train phase."""
        if self._train_start is not None:
            if self.model_device.type == "cuda":
                torch.cuda.synchronize(self.model_device)  # the optimizer step is queued, not done
            self.phase["train_s"] = time.perf_counter() - self._train_start
            self._train_start = None
        out = {k: float(np.mean(v)) for k, v in self.stats.items()}  # over the whole step's rewards already
        loss_keys = sorted(self.loss.metrics)
        local = []
        for k in loss_keys:
            values = torch.stack([x.float() for x in self.loss.metrics[k]])
            local.append((values.max() if k.endswith("/max") else values.mean()).item())
        phases = sorted(self.phase)
        # every rank logs the same keys at the same steps: the loss metrics over the ranks (the max of maxima,
        # the mean of means: each rank ran as many micro-batches), the phase times of the slowest rank
        ranks = self.ranks.gather(tuple(local) + tuple(self.phase[k] for k in phases))
        for j, k in enumerate(loss_keys):
            column = [r[j] for r in ranks]
            out[k] = max(column) if k.endswith("/max") else float(np.mean(column))
        for j, k in enumerate(phases, len(loss_keys)):
            out[k] = max(r[j] for r in ranks)
        self.stats.clear()
        self.loss.metrics.clear()
        out["kv_cache_freed_bytes"] = self.kv_freed
        return out

    def summary(self, run, final: dict) -> dict:
        return {"model": self.base_name, "loss_type": self.cfg.loss_type, "beta": self.cfg.beta,
                "prompts": len(self.prompt_ids)}

    def export(self, run) -> dict:
        self.policy.export(run.out)
        return {}
