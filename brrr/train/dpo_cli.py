"""`brrr dpo`: preference optimization (brrr/train/dpo.py), registered by brrr/train/cli.py."""
from __future__ import annotations

import json

from brrr.cli import HelpFormatter
from brrr.train.dpo import DPOConfig
from brrr.train.dpo_loss import LOSS_TYPES
from brrr.train.post_training_flags import add_loop_flags, add_policy_flags, config_from_args


def register(sub):
    defaults = DPOConfig("", "", "")
    d, t = defaults.loop, defaults.task
    p = sub.add_parser("dpo", help="Direct Preference Optimization on preference pairs (TRL's format)",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="an HF model directory or hub id (default: brrr's model)")
    p.add_argument("--data", required=True,
                   help='JSONL, one pair a line: {"prompt", "chosen", "rejected"} as strings, or as chat messages '
                        '(then "prompt" may be left out: the messages the two share)')
    p.add_argument("--out", required=True,
                   help="output: an HF model directory (or a PEFT adapter with --use-peft), checkpoint/, "
                        "train_log.jsonl")
    p.add_argument("--beta", type=float, default=t.beta, help="strength of the pull toward the reference")
    p.add_argument("--loss-type", default=t.loss_type, choices=list(LOSS_TYPES),
                   help="sigmoid (DPO), ipo (IPO, per-token averaged log-ratios), hinge (SLiC)")
    p.add_argument("--max-length", dest="seq_len", type=int, default=d.seq_len,
                   help="tokens of prompt + completion kept (the completion is cut)")
    p.add_argument("--precompute-ref-log-probs", action="store_true",
                   help="with --use-peft: the reference's log-probs computed once before step 1, not in each step")
    add_policy_flags(p, t)
    add_loop_flags(p, d)
    p.set_defaults(func=cmd_dpo)


def cmd_dpo(args) -> int:
    from brrr.train.trainer import Trainer  # the loop imports the parallel stack: only when a run starts

    summary = Trainer(config_from_args(DPOConfig, args)).run()
    print(json.dumps(summary, indent=2))
    return 0
