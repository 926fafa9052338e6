"""MoE training: the loss with transformers' load-balancing term and its gradients equal transformers' on tiny
Mixtral and Qwen3-MoE models, the router z-loss equals Switch Transformers', and `brrr train` on an MoE config logs
each expert's tokens."""
import json

import pytest
import torch
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

from brrr import load_model
from brrr.train.loss import IGNORE_INDEX, CausalLMLoss
from brrr.train.moe_loss import MoELoss, router_z_loss
from brrr.train.trainer import TrainConfig, Trainer
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
