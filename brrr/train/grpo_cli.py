"""`brrr grpo`: RL with group-relative advantages, rolling out through brrr's engine in this process (under
torchrun: in each rank's), brrr/train/grpo.py; registered by brrr/train/cli.py."""
from __future__ import annotations

import argparse

from brrr.cli import HelpFormatter
from brrr.train.grpo import GRPOConfig
from brrr.train.grpo_loss import IS_MODES, LOSS_TYPES, SCALE_REWARDS
from brrr.train.launch_cli import run_trainer
from brrr.train.post_training_flags import add_loop_flags, add_policy_flags, config_from_args
from brrr.train.rewards import BUILTIN


def register(sub):
    defaults = GRPOConfig("", "", "")
    d, t = defaults.loop, defaults.task
    p = sub.add_parser("grpo", help="GRPO: sample groups with brrr's engine in this process, train on their rewards",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="an HF model directory or hub id (default: brrr's model)")
    p.add_argument("--prompts", required=True,
                   help='JSONL, one prompt a line: {"prompt": text or chat messages, ...fields the rewards read}')
    p.add_argument("--reward", action="append", required=True, metavar="MODULE:FUNCTION",
                   help=f"a reward function f(prompts, completions, completion_ids, **fields) -> floats: "
                        f"MODULE:FUNCTION, path/to/file.py:FUNCTION, or a built-in ({', '.join(BUILTIN)}); "
                        f"repeat to sum several")
    p.add_argument("--reward-weights", type=float, nargs="+", default=None,
                   help="one weight per --reward, in order (default: 1 each)")
    p.add_argument("--out", required=True,
                   help="output: an HF model directory (or a PEFT adapter with --use-peft), checkpoint/, "
                        "train_log.jsonl")
    p.add_argument("--num-generations", type=int, default=t.num_generations, help="completions per prompt (a group)")
    p.add_argument("--max-completion-length", type=int, default=t.max_completion_length,
                   help="tokens a completion may have")
    p.add_argument("--beta", type=float, default=t.beta, help="weight of the KL to the reference (0: none computed)")
    p.add_argument("--epsilon", type=float, default=t.epsilon, help="the ratio is clipped to [1 - epsilon, ...]")
    p.add_argument("--epsilon-high", type=float, default=t.epsilon_high,
                   help="... 1 + epsilon_high] (DAPO's clip-higher; default: epsilon)")
    p.add_argument("--loss-type", default=t.loss_type, choices=list(LOSS_TYPES),
                   help="grpo: mean per sequence; dr_grpo: / (sequences x max completion length); dapo: / tokens")
    p.add_argument("--scale-rewards", default=t.scale_rewards, choices=list(SCALE_REWARDS),
                   help="divide advantages by the reward std of the group, of the batch, or not (Dr. GRPO)")
    p.add_argument("--temperature", type=float, default=t.temperature, help="sampling temperature of the rollouts")
    p.add_argument("--top-p", type=float, default=t.top_p, help="nucleus sampling of the rollouts")
    p.add_argument("--top-k", type=int, default=t.top_k, help="top-k sampling of the rollouts (0: off)")
    p.add_argument("--importance-sampling-correction", action=argparse.BooleanOptionalAction,
                   default=t.importance_sampling_correction,
                   help="weight each token by exp(trainer logp - engine logp), truncated (at temperature 1, no "
                        "top-p/top-k: where the engine's log-probs are the sampling distribution's)")
    p.add_argument("--importance-sampling-mode", default=t.importance_sampling_mode, choices=list(IS_MODES),
                   help="per token or per sequence; truncate at the cap, or mask out beyond it")
    p.add_argument("--importance-sampling-clip-max", type=float, default=t.importance_sampling_clip_max,
                   help="the cap of the importance weights")
    p.add_argument("--batch-invariant", action="store_true",
                   help="engine and trainer in the batch-invariant mode: at temperature 1 (no top-p/top-k) the "
                        "rollout's log-probs equal the trainer's bit for bit (needs --lora-dropout 0 with "
                        "--use-peft; the trainer's forwards run outside autocast; docs/batch-invariance.md)")
    add_policy_flags(p, t)
    add_loop_flags(p, d)
    p.set_defaults(func=cmd_grpo)


def cmd_grpo(args) -> int:
    """Alone or under torchrun (DDP over the ranks: brrr/train/grpo.py)."""
    return run_trainer(config_from_args(GRPOConfig, args))
