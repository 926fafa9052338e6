"""brrr grpo end to end on a tiny model, rolling out through the engine in this process: a short run learns to emit
tokens from a target set (mean reward up by a margin) where the same run with the rewards shuffled within each step
does not; after a train step the engine's next rollout scores its tokens as the trainer's updated model does (the
weights are shared, nothing copied) and the KV cache freed for training is back; the CLI writes its log with the
phase times and the engine-vs-trainer mismatch; bad flags fail clearly."""
import json

import numpy as np
import pytest
import torch

from brrr.cli import main
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams
from brrr.train.completion_batch import completion_logprobs
from brrr.train.grpo import GRPOConfig, GRPOTask
from brrr.train.rewards import Rewards
from brrr.train.trainer import Trainer
from tests.hf_models import build, save, save_tokenizer

TARGET = set(range(40, 72))  # a tenth of the vocabulary


def target_share(prompts, completions, completion_ids, **kw):
    return [sum(t in TARGET for t in c) / len(c) for c in completion_ids]


class Shuffled:
    """The same rewards, permuted within each call (each step): no signal left about which completion earned it."""
    __name__ = "shuffled_target_share"

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def __call__(self, **kw):
        return list(self.rng.permutation(target_share(**kw)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    path = save_tokenizer(save(build("llama3-rope", vocab_size=320), root / "model"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "answer": str(i)}) + "\n" for i in range(8)))
    return path, prompts


def _cfg(tiny, out, **kw):
    base = dict(num_generations=8, micro_batch=16, max_completion_length=6, lr=1e-2, max_steps=12, log_every=1,
                checkpoint_every=100, reward=["custom"])
    return GRPOConfig(str(tiny[0]), str(tiny[1]), str(out), **{**base, **kw})


def _rewards(out):
    return [r["reward"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "reward" in r]


def test_grpo_learns_where_shuffled_rewards_do_not(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path / "real"), GRPOTask(_cfg(tiny, "").task, Rewards([target_share]))).run()
    Trainer(_cfg(tiny, tmp_path / "shuffled"), GRPOTask(_cfg(tiny, "").task, Rewards([Shuffled()]))).run()
    real, shuffled = _rewards(tmp_path / "real"), _rewards(tmp_path / "shuffled")
    gain = np.mean(real[-3:]) - np.mean(real[:3])
    control = np.mean(shuffled[-3:]) - np.mean(shuffled[:3])
    assert gain > 0.2 and control < 0.1 and gain > control + 0.15, (real, shuffled)


def test_weight_sync_and_kv_memory_after_a_train_step(tiny, tmp_path):
    task = GRPOTask(_cfg(tiny, "").task, Rewards([target_share]))
    trainer = Trainer(_cfg(tiny, tmp_path / "out", max_steps=1), task)
    kv = task.engine.kv_cache_bytes()
    prompt = task.prompt_ids[0]
    params = [SamplingParams(n=2, max_tokens=6, logprobs=0, seed=5)]
    before = task.engine.generate([prompt], params)[0].outputs
    trainer.run()
    assert task.engine.asleep and task.engine.kv_cache_bytes() == 0 and task.kv_freed == kv
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["kv_cache_freed_bytes"] == kv
    task.engine.sync_weights()
    task.engine.wake()
    assert task.engine.kv_cache_bytes() == kv
    after = task.engine.generate([prompt], params)[0].outputs
    tokens = [list(s.token_ids) for s in after]
    engine = torch.tensor([[next(iter(e.values())) for e in s.logprobs] for s in after])
    with torch.no_grad():
        trainer_new = completion_logprobs(task.model, [prompt] * 2, tokens, "cpu")
    torch.testing.assert_close(engine, trainer_new, rtol=1e-5, atol=1e-5)
    # the weights did move: the old rollout's tokens score differently now
    old_engine = torch.tensor([[next(iter(e.values())) for e in s.logprobs] for s in before])
    with torch.no_grad():
        rescored = completion_logprobs(task.model, [prompt] * 2, [list(s.token_ids) for s in before], "cpu")
    assert (rescored - old_engine).abs().max() > 1e-3


def test_cli_logs_phases_and_mismatch(tiny, tmp_path):
    out = tmp_path / "cli"
    rc = main(["grpo", "--model", str(tiny[0]), "--prompts", str(tiny[1]), "--out", str(out),
               "--reward", "python_syntax", "--reward", "exact_match", "--reward-weights", "1", "0.5",
               "--num-generations", "4",
               "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
               "--max-completion-length", "4", "--max-steps", "2", "--beta", "0.1", "--use-peft", "--lora-r", "4",
               "--loss-type", "grpo", "--learning-rate", "1e-3"])
    assert rc == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if '"reward"' in x]
    for key in ("rollout_s", "reference_logps_s", "train_s", "weight_sync_s", "wake_s", "logprob_mismatch/max",
                "logprob_mismatch/mean", "rewards/python_syntax/mean", "rewards/exact_match/mean", "kl"):
        assert key in log[-1], key
    assert log[-1]["logprob_mismatch/max"] < 1e-4  # fp32 on the CPU: the engine and the trainer agree
    assert (out / "adapter_config.json").is_file()


@pytest.mark.parametrize("invariant, peft", [(True, False), (True, True), (False, False)])
def test_batch_invariant_rollout_logprobs_are_the_trainers(tiny, tmp_path, invariant, peft):
    """--batch-invariant: at step 0 the engine's per-token log-probs of the rollout are the trainer's old-policy
    log-probs of the same completions bit for bit (its first micro-batch forward, gradients on, train mode), so the
    logged mismatch is 0; with the mode off they agree up to rounding."""
    kw = dict(num_generations=4, micro_batch=8, max_steps=1, max_completion_length=8, batch_invariant=invariant,
              **(dict(use_peft=True, lora_r=4, lora_dropout=0.0) if peft else {}))
    task = GRPOTask(_cfg(tiny, "", **kw).task, Rewards([target_share]))
    trainer = Trainer(_cfg(tiny, tmp_path / "run", **kw), task)
    prompts, completions, _, _, engine, _ = task.batches.batch_at(0, trainer.device)
    assert task.engine.core.config.batch_invariant is invariant
    assert max(map(len, completions)) > 1 and not engine.isnan().any()
    task.model.train()
    with task.scoring(trainer.device):
        mine = completion_logprobs(task.model, prompts, completions, trainer.device)
    assert mine.requires_grad
    if invariant:
        assert torch.equal(mine.detach(), engine), (mine.detach() - engine).abs().max()
    else:
        torch.testing.assert_close(mine.detach(), engine, rtol=1e-4, atol=1e-4)
    task.loss.metrics.clear()
    trainer.run()  # step 0 again from its cached rollout, through GRPOLoss
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines() if '"reward"' in x]
    if invariant:
        assert log[0]["logprob_mismatch/max"] == 0.0
    assert log[0]["train_s"] > 0 and log[0]["rollout_s"] > 0


def test_batch_invariant_refuses_what_breaks_bit_identity(tiny, tmp_path):
    with pytest.raises(BrrrError, match="--batch-invariant needs --lora-dropout 0"):
        Trainer(_cfg(tiny, tmp_path / "a", batch_invariant=True, use_peft=True))
    with pytest.raises(BrrrError, match="--batch-invariant does not combine with --qlora"):
        Trainer(_cfg(tiny, tmp_path / "b", batch_invariant=True, qlora=True, lora_dropout=0.0))


def test_bad_flags(tiny, tmp_path):
    with pytest.raises(BrrrError, match="multiple of --num-generations"):
        Trainer(_cfg(tiny, tmp_path / "a", micro_batch=6))
    with pytest.raises(BrrrError, match="--loss-type"):
        Trainer(_cfg(tiny, tmp_path / "b", loss_type="ppo"))
    with pytest.raises(BrrrError, match="MODULE:FUNCTION"):
        Trainer(_cfg(tiny, tmp_path / "c", reward=["nope"]))


def test_copied_serving_form_syncs_in_place(tiny):
    """The engine's own packed copy (what fp32 master weights on CUDA roll out from, here fp32 on the CPU): until
    sync_weights it runs the old weights, after it the trainer's new ones, copied into its packed tensors."""
    from brrr.loader import load_model
    from brrr.tokenizer import Tokenizer
    from brrr.train.rollout import ColocatedRollout

    model = load_model(tiny[0], dtype=torch.float32)
    tok = Tokenizer.from_dir(tiny[0])
    rollout = ColocatedRollout(model, tok, (tok.eos_token_id,), 64, 8, copy_dtype=torch.float32,
                               pack_projections=True)
    assert not rollout.shared and any("qkv_proj" in n for n, _ in rollout.core.model.named_parameters())
    with torch.no_grad():  # a train step's in-place update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt, params = tok.encode("def f(x):"), [SamplingParams(n=2, max_tokens=6, logprobs=0, seed=2)]

    def engine_vs_trainer():
        out = rollout.generate([prompt], params)[0].outputs
        engine = torch.tensor([[next(iter(e.values())) for e in s.logprobs] for s in out])
        with torch.no_grad():
            mine = completion_logprobs(model, [prompt] * 2, [list(s.token_ids) for s in out], "cpu")
        return (engine - mine).abs().max()

    assert engine_vs_trainer() > 1e-3  # stale: the engine still runs the weights it copied at start
    assert rollout.sync_weights() >= 0
    assert engine_vs_trainer() < 1e-4


def test_resume_continues_bit_for_bit(tiny, tmp_path):
    """Rollouts are seeded by (seed, step, prompt): a run halted at step 2 and resumed ends on the same weights."""
    from brrr.loader import load_model

    kw = dict(num_generations=4, micro_batch=8, max_steps=4, checkpoint_every=2)
    for out, extra in (("straight", {}), ("halted", dict(stop_at=2)), ("halted", dict(resume=True))):
        cfg = _cfg(tiny, tmp_path / out, **kw, **extra)
        Trainer(cfg, GRPOTask(cfg.task, Rewards([target_share]))).run()
    a, b = (load_model(tmp_path / d, dtype=torch.float32).state_dict() for d in ("straight", "halted"))
    assert all(torch.equal(a[k], b[k]) for k in a)
