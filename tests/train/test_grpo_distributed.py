"""brrr grpo on 2 CPU processes (gloo, DDP) against one process with the same global step: each rank rolls out its
block of whole groups with its own colocated engine, seeded by the global prompt counter, so the two ranks together
sample the one process's completions token for token; the rewards are gathered (the advantages, --scale-rewards
batch's std, dapo's token count and the logged reward are the whole step's) and DDP averages the gradients, so
losses and final weights agree within fp32 reduction order (1e-5), for the grpo, dr_grpo and dapo loss types and for LoRA adapters (their DCP checkpoint holds the adapters alone). A
layout GRPO cannot serve (TP, PP, FSDP's shards) is refused by its flag."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from brrr.errors import BrrrError
from brrr.train.grpo import GRPOConfig, GRPOTask
from brrr.train.rewards import Rewards
from brrr.train.trainer import Trainer
from tests.hf_models import build, save, save_tokenizer
from tests.train.distributed_helpers import spawn, train_losses

ATOL = 1e-5
GROUPS_PER_STEP = 4  # global: 2 per rank on 2 ranks, one group per micro-batch either way
CASES = {"grpo": dict(loss_type="grpo"), "dr_grpo_kl": dict(loss_type="dr_grpo", beta=0.1),
         "dapo_batch_std": dict(loss_type="dapo", scale_rewards="batch"),
         "grpo_lora": dict(loss_type="grpo", use_peft=True, lora_r=4, lora_dropout=0.0)}


class RecordedReward:
    """A fixed reward (the share of even token ids) that writes what it scored, by prompt row, to OUT/scored-*:
    each call is one step of one rank."""
    __name__ = "even_share"

    def __init__(self, out):
        self.out, self.calls = Path(out), 0

    def __call__(self, completion_ids, row, **kw):
        with open(self.out / f"scored-{os.environ.get('RANK', 0)}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.calls, "rows": row, "completions": completion_ids}) + "\n")
        self.calls += 1
        return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]


class RecordedConfig(GRPOConfig):
    def make_task(self):
        Path(self.loop.out).mkdir(parents=True, exist_ok=True)
        return GRPOTask(self.task, Rewards([RecordedReward(self.loop.out)]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_dist")
    path = save_tokenizer(save(build("llama3-rope", vocab_size=320), root / "model"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "row": i}) + "\n" for i in range(6)))
    return path, prompts


def _cfg(tiny, out, ranks: int, **kw) -> RecordedConfig:
    g = 4
    base = dict(device="cpu", num_generations=g, micro_batch=g, grad_accum=GROUPS_PER_STEP // ranks,
                max_completion_length=5, lr=1e-2, max_steps=2, log_every=1, checkpoint_every=100, reward=["custom"])
    return RecordedConfig(str(tiny[0]), str(tiny[1]), str(out), **{**base, **kw})


def _scored(out) -> dict:
    """{step: {prompt row: its group's completions}} over every rank's file."""
    by_step: dict = {}
    for path in sorted(Path(out).glob("scored-*.jsonl")):
        for rec in map(json.loads, path.read_text().splitlines()):
            step = by_step.setdefault(rec["step"], {})
            for i, c in zip(rec["rows"], rec["completions"]):
                step.setdefault(i, []).append(c)
    return by_step


def _log(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines() if '"reward"' in x]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_dist_runs")
    for name, flags in CASES.items():
        Trainer(_cfg(tiny, root / f"single_{name}", 1, **flags)).run()
    spawn(2, [_cfg(tiny, root / name, 2, **flags) for name, flags in CASES.items()])
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_process(runs, name):
    ref, out = runs / f"single_{name}", runs / name
    want, got = _scored(ref), _scored(out)
    assert sorted(got) == sorted(want) == [0, 1]
    assert got == want  # every prompt's group: the same tokens, from whichever rank rolled it out
    assert len(list(out.glob("scored-*.jsonl"))) == 2  # both ranks did roll out
    assert sum(len(g) for g in want[0].values()) == GROUPS_PER_STEP * 4
    # at TRL's num_iterations 1 the ratio is 1 and the group-centred advantages make the loss's value ~0 (its
    # gradient is not): the gradient norm is the sharper check of each step
    assert train_losses(out) == pytest.approx(train_losses(ref), abs=ATOL)
    log, ref_log = _log(out), _log(ref)
    assert len(log) == len(ref_log) == 2 and all(r["grad_norm"] > 0.1 for r in ref_log)
    for a, b in zip(log, ref_log):  # the logged rewards are the whole step's
        for key in ("grad_norm", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl"):
            assert a.get(key) == pytest.approx(b.get(key), abs=ATOL), key
    file = "adapter_model.safetensors" if CASES[name].get("use_peft") else "model.safetensors"
    w_ref, w_out = load_file(ref / file), load_file(out / file)
    assert w_ref.keys() == w_out.keys()
    if CASES[name].get("use_peft"):  # the adapters' B starts at zero
        moved = max(v.abs().max().item() for k, v in w_ref.items() if "lora_B" in k)
    else:
        base = load_file(Path(json.loads((ref / "train_config.json").read_text())["model"]) / file)
        moved = max((w_ref[k] - base[k]).abs().max().item() for k in w_ref if k in base)
    assert moved > 1e-3  # the weights did train
    for key in w_ref:
        torch.testing.assert_close(w_out[key], w_ref[key], atol=ATOL, rtol=0, msg=key)


@pytest.mark.parametrize("flags, flag", [(dict(tp=2), "--tp 2"), (dict(pp=2), "--pp 2"),
                                         (dict(dp_shard=2), "--dp-shard 2")])
def test_unsupported_layouts_are_refused_by_flag(tiny, tmp_path, flags, flag):
    with pytest.raises(BrrrError, match=flag):
        Trainer(_cfg(tiny, tmp_path / "x", 1, **flags))
