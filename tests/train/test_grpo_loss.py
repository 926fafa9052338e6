"""GRPO's math against TRL's GRPOTrainer on fixed completions and rewards (TRL's rollout_func hands it our token
ids, so no generation runs): its advantages for each scale_rewards, and for each loss type the loss and every
parameter's gradient (beta > 0 with a reference that differs from the policy, clipping exercised by perturbed
old log-probs) equal brrr's to 1e-5. The truncated importance weights follow their formula."""
import copy
import math

import pytest
import torch

from brrr.errors import BrrrError
from brrr.loader import load_model
from brrr.tokenizer import Tokenizer
from brrr.train.completion_batch import completion_logprobs, completion_mask
from brrr.train.grpo_loss import group_advantages, grpo_loss, importance_weights
from tests.hf_models import build, save, save_tokenizer

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

G = 4
PROMPTS = ["def add(a, b):", "Hello, "]
REWARDS = [1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    ref = build("llama3-rope", vocab_size=320)
    policy = copy.deepcopy(ref)
    torch.manual_seed(4)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return (save_tokenizer(save(ref, tmp_path_factory.mktemp("ref"))),
            save_tokenizer(save(policy, tmp_path_factory.mktemp("policy"))))


def completions():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(len(PROMPTS) * G)]


def trl_step(dirs, tmp_path, loss_type, scale_rewards, beta):
    """TRL's advantages, loss and gradients for the fixed completions; the old log-probs are moved by a fixed
    amount so that some ratios leave the clip range."""
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(dirs[1])
    comps = completions()

    def rollout(prompts, trainer):
        return {"prompt_ids": [tok(p).input_ids for p in prompts], "completion_ids": comps,
                "logprobs": [[0.0] * len(c) for c in comps]}

    def reward(prompts, completions, completion_ids, **kw):
        return [REWARDS[comps.index(c)] for c in completion_ids]

    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                          num_generations=G, per_device_train_batch_size=len(REWARDS), max_completion_length=8,
                          beta=beta, loss_type=loss_type, scale_rewards=scale_rewards, epsilon_high=0.28)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok, rollout_func=rollout,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    # the policy moves away from the reference TRL copied at start: the policy's weights are dirs[1]'s
    model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.float32).state_dict())
    model.train()
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].size(1))
    out["old_per_token_logps"] = logps + old_shift(logps.shape)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, out)
    loss.backward()
    return out, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def old_shift(shape):
    return 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("loss_type,scale_rewards,beta", [("grpo", "group", 0.1), ("dr_grpo", "none", 0.1),
                                                         ("dapo", "batch", 0.0), ("dapo", "group", 0.04)])
def test_loss_and_gradients_equal_trl(dirs, tmp_path, loss_type, scale_rewards, beta):
    out, theirs, their_grads = trl_step(dirs, tmp_path, loss_type, scale_rewards, beta)
    advantages, _ = group_advantages(torch.tensor(REWARDS), G, scale_rewards)
    torch.testing.assert_close(advantages, out["advantages"], rtol=1e-6, atol=1e-6)
    tok = Tokenizer.from_dir(dirs[1])
    prompts, comps = [tok.encode(p) for p in PROMPTS for _ in range(G)], completions()
    policy, ref = load_model(dirs[1], dtype=torch.float32), load_model(dirs[0], dtype=torch.float32)
    policy.requires_grad_(True)
    mask = completion_mask([len(c) for c in comps], "cpu")
    torch.testing.assert_close(mask, out["completion_mask"].float())
    with torch.no_grad():
        ref_logps = completion_logprobs(ref, prompts, comps, "cpu")
    logps = completion_logprobs(policy, prompts, comps, "cpu")
    old = (logps.detach() + old_shift(logps.shape)) * mask
    loss, metrics = grpo_loss(logps, old, ref_logps, advantages, mask, loss_type=loss_type, beta=beta,
                              epsilon=0.2, epsilon_high=0.28, max_completion_length=8, num_items=mask.sum())
    assert metrics["clip_ratio/region_mean"] > 0  # some tokens are clipped
    assert beta == 0 or metrics["kl"] > 1e-4
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs, rtol=1e-5, atol=1e-6)
    for name, g in their_grads.items():
        torch.testing.assert_close(policy.get_parameter(name).grad, g, rtol=1e-5, atol=1e-6, msg=name)


def test_advantages_and_importance_weights():
    r = torch.tensor([1.0, 1.0, 3.0, float("nan"), 0.0, 0.0])
    adv, std = group_advantages(r, 3, "group")
    assert adv[0] == pytest.approx(-2 / 3 / (2 / math.sqrt(3) + 1e-4), rel=1e-5)  # (1 - 5/3) / sample std
    assert adv[3] == 0 and (adv[4:] == 0).all() and std[4:].eq(0).all()  # NaN left out; a flat group: no signal
    with pytest.raises(BrrrError, match="--num-generations"):
        group_advantages(torch.zeros(5), 3)
    old, sampled = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-2.0, -1.0, -2.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    tok = importance_weights(old, sampled, mask, "token_truncate", clip_max=3.0)
    torch.testing.assert_close(tok, torch.tensor([[3.0, 1.0, 1.0]]))  # e^2 capped at 3; masked token exactly 1
    seq = importance_weights(old, sampled, mask, "sequence_mask", clip_max=3.0)
    torch.testing.assert_close(seq, torch.tensor([[0.0]]))  # e^2 > 3: the sequence is masked out


def test_importance_weights_scale_the_policy_term_only():
    """TRL multiplies the clipped policy term by the importance weights before adding beta * KL."""
    torch.manual_seed(0)
    logps = torch.randn(3, 4, requires_grad=True)
    ref, adv, mask = torch.randn(3, 4), torch.tensor([1.0, -0.5, 0.2]), torch.ones(3, 4)
    kw = dict(loss_type="dapo", num_items=12.0)
    plain, _ = grpo_loss(logps, None, None, adv, mask, **kw)
    doubled, _ = grpo_loss(logps, None, None, adv, mask, is_weights=torch.full((3, 4), 2.0), **kw)
    torch.testing.assert_close(doubled, 2 * plain)
    kl_only = grpo_loss(logps, None, ref, torch.zeros(3), mask, beta=0.5, is_weights=torch.full((3, 4), 2.0),
                        **kw)[0]
    torch.testing.assert_close(kl_only, 0.5 * (torch.exp(ref - logps) - (ref - logps) - 1).sum() / 12)
