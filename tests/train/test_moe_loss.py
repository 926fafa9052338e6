"""MoE training: the loss with transformers' load-balancing term and its gradients equal transformers' on tiny
Mixtral and Qwen3-MoE models, the router z-loss equals Switch Transformers', `brrr train` on an MoE config logs
each expert's tokens, and DeepSeek-V3's bias balancing is its formula and evens skewed loads."""
import contextlib
import json

import pytest
import torch
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

from brrr import load_model
from brrr.errors import BrrrError
from brrr.kernels.moe_routing import route
from brrr.models.moe import Router
from brrr.train.loss import IGNORE_INDEX, CausalLMLoss
from brrr.train.moe_loss import MoELoss, router_z_loss
from brrr.train.trainer import TrainConfig, Trainer, optimizer_step
from tests import hf_models


def _expert_grad(model, name):
    """brrr's gradient for transformers v5's fused expert tensor `name` (gate_up_proj [E, 2I, H], down_proj)."""
    layer = int(name.split(".")[2])
    experts = model.model.layers[layer].mlp.experts
    if name.endswith("gate_up_proj"):
        return torch.stack([torch.cat([p.weight.grad for p in e.projections()[:2]]) for e in experts])
    return torch.stack([e.projections()[2].weight.grad for e in experts])


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe-norm-topk"])
def test_loss_and_gradients_equal_transformers_with_the_aux_loss(family, tmp_path):
    hf = hf_models.build(family, router_aux_loss_coef=0.3, output_router_logits=True).train()
    hf_models.save(hf, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32).requires_grad_(True).train()
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    loss = MoELoss(CausalLMLoss(model), model, model.config, model.config.router_aux_loss_coef, 0.0)
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], 1)  # transformers' shifted labels
    ours = loss(ids, targets)
    ours.backward()
    assert model.config.router_aux_loss_coef == 0.3 and out.aux_loss.item() > 1.0
    assert abs(ours.item() - out.loss.item()) <= 1e-5
    for name, p in hf.named_parameters():
        got = _expert_grad(model, name) if ".experts." in name else model.get_parameter(name).grad
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    counts = loss.take_counts()  # every token's top-k counted in each MoE layer
    assert [sum(c) for c in counts] == [3 * 24 * model.config.num_experts_per_tok] * len(counts)


def test_router_z_loss_equals_switch_transformers():
    logits = [torch.randn(10, 8, generator=torch.Generator().manual_seed(i)) * 3 for i in range(3)]
    torch.testing.assert_close(router_z_loss(logits), router_z_loss_func(torch.cat(logits)[None]))


def test_brrr_train_on_an_moe_config_logs_expert_tokens(data_dir, tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
           "router_aux_loss_coef": 0.01}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = TrainConfig(str(tmp_path / "config.json"), str(data_dir), str(tmp_path / "out"), device="cpu", seq_len=32,
                      micro_batch=2, grad_accum=1, max_steps=4, lr=3e-3, warmup_steps=1, eval_every=4, eval_windows=2,
                      log_every=2, checkpoint_every=4, final_eval_windows=2, router_z_loss_coef=1e-3)
    Trainer(run).run()
    logs = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "expert_tokens" in r]
    assert [r["step"] for r in steps] == [2, 4]
    for r in steps:  # 2 steps x 2 sequences x 32 tokens x top-2, per MoE layer, over its 4 experts
        assert [len(c) for c in r["expert_tokens"]] == [4, 4]
        assert [sum(c) for c in r["expert_tokens"]] == [2 * 2 * 32 * 2] * 2
    reloaded = load_model(tmp_path / "out", dtype=torch.float32)  # the export is an MoE checkpoint brrr loads
    assert reloaded.config.num_experts == 4


# -- DeepSeek-V3's auxiliary-loss-free balancing (--moe-bias-update-speed) ----------------------------------------

def _v3_model(path):
    """A tiny DeepSeek-V3 (one dense layer, one MoE layer of 8 experts, top 3 in 2 of 4 groups), biases at zero."""
    if not (path / "config.json").exists():
        hf_models.save(hf_models.build("deepseek-v3"), path)
    model = load_model(path, dtype=torch.float32).requires_grad_(True).train()
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.zero_()
    return model


def _biases(model):
    return [b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]


def _steps(model, gamma, batches, steps):
    """`steps` AdamW steps on the same micro-batches, the bias update after each; -> each step's loads."""
    loss = MoELoss(CausalLMLoss(model), model, model.config, 0.0, 0.0, gamma)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    loads = []
    for _ in range(steps):
        optimizer_step(loss, opt, params, batches, 1.0, contextlib.nullcontext())
        loads.append(loss.step_loads.clone())
        loss.balance_step()
    return loads


def _skewed_batches():
    """Code-like skew: every token from 16 of the 256 ids, so a few experts take most of the routing."""
    ids = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(0))
    return [(ids[:2], ids[:2].roll(-1, 1)), (ids[2:], ids[2:].roll(-1, 1))]


def test_the_bias_update_is_deepseeks_formula_for_one_step(tmp_path):
    model, gamma = _v3_model(tmp_path), 0.01
    routers = [m for m in model.modules() if isinstance(m, Router)]
    seen = []  # the routers' logits, recorded here independently of MoELoss
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: seen.append((mod, out.detach())))
    with torch.no_grad():  # a nonzero start, so the update adds to it
        for r in routers:
            r.e_score_correction_bias.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    before = _biases(model)
    loss = MoELoss(CausalLMLoss(model), model, model.config, 0.0, 0.0, gamma)
    for inputs, targets in _skewed_batches():  # one step's two micro-batches
        loss(inputs, targets).backward()
    cfg = model.config
    counts = {r: torch.zeros(cfg.num_experts) for r in routers}
    for r, logits in seen:
        ids = route(logits, cfg.num_experts_per_tok, cfg.router_scoring, False, cfg.n_group, cfg.topk_group,
                    r.e_score_correction_bias)[1]
        counts[r] += torch.bincount(ids.flatten(), minlength=cfg.num_experts)
    loss.balance_step()
    assert len(routers) == 1 and sum(counts[routers[0]]) == 4 * 32 * cfg.num_experts_per_tok
    for r, b0 in zip(routers, before):
        load = counts[r]
        assert load.min() < load.mean() < load.max()  # some experts over, some under
        assert torch.equal(r.e_score_correction_bias, b0 + gamma * torch.sign(load.mean() - load))
    assert loss.step_loads is None  # the next step counts afresh
    assert all(r.e_score_correction_bias.grad is None for r in routers)  # a buffer: no gradient


def test_bias_balancing_evens_the_loads_on_skewed_data(tmp_path):
    ratio = {}
    for gamma in (0.0, 0.02):
        loads = _steps(_v3_model(tmp_path), gamma, _skewed_batches(), 8)
        ratio[gamma] = [(l.max() / l.min().clamp(min=1)).item() for l in loads]
    assert ratio[0.0][0] == ratio[0.02][0] > 2  # the first step routes by the same zero bias: skewed
    assert ratio[0.02][-1] < ratio[0.02][0] and ratio[0.02][-1] < ratio[0.0][-1] / 2


def test_a_zero_update_speed_leaves_the_bias_alone(tmp_path):
    model = _v3_model(tmp_path)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    before = _biases(model)
    _steps(model, 0.0, _skewed_batches(), 2)
    assert all(torch.equal(a, b) for a, b in zip(before, _biases(model)))


def _save_config(family, path):
    """The tiny family's config.json at the data build's vocabulary (what `brrr train --config` reads)."""
    model = hf_models.build(family, vocab_size=400)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)


def test_brrr_train_moves_the_bias_by_the_logged_loads(data_dir, tmp_path):
    """Through the trainer: log_every 1 logs each step's loads; the exported bias is their updates summed."""
    _save_config("deepseek-v3", tmp_path / "cfg")
    gamma = 0.01
    run = TrainConfig(str(tmp_path / "cfg" / "config.json"), str(data_dir), str(tmp_path / "out"), device="cpu",
                      seq_len=32, micro_batch=2, grad_accum=2, max_steps=3, lr=1e-3, warmup_steps=1, eval_every=3,
                      eval_windows=1, log_every=1, checkpoint_every=3, final_eval_windows=1,
                      moe_bias_update_speed=gamma)
    Trainer(run).run()
    logs = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    expected = torch.zeros(8)
    for r in [r for r in logs if "expert_tokens" in r]:
        (load,) = torch.tensor(r["expert_tokens"], dtype=torch.float32)  # the one MoE layer
        assert load.sum() == 2 * 2 * 32 * 3
        expected += gamma * torch.sign(load.mean() - load)
    (bias,) = _biases(load_model(tmp_path / "out", dtype=torch.float32))
    assert expected.abs().sum() > 0
    torch.testing.assert_close(bias, expected, atol=1e-7, rtol=0)


def test_the_bias_update_needs_deepseek_v3_routing(data_dir, tmp_path):
    _save_config("mixtral", tmp_path)
    run = TrainConfig(str(tmp_path / "config.json"), str(data_dir), str(tmp_path / "out"), device="cpu", seq_len=32,
                      micro_batch=2, max_steps=1, moe_bias_update_speed=0.001)
    with pytest.raises(BrrrError, match="e_score_correction_bias.*routes by softmax"):
        Trainer(run)
