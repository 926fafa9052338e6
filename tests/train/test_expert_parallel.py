"""Expert parallelism under gloo: 2 ranks, each holding half the experts and half of every batch, train 10 steps
with the one-process run's losses (within 5e-5) and parameters; so do `brrr train --ep 2` (2 ranks) and
`--ep 2 --dp-shard 2` (4 ranks: FSDP2 over the experts' holders beside EP), their final weights and validation loss
too, and a checkpoint resumes across the layouts; an idle expert still gets a (zero) gradient; layouts EP does not
take are refused by flag."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from brrr import load_model
from brrr.config import ModelConfig
from brrr.errors import BrrrError
from brrr.models.moe import GatedMLP
from brrr.train.loss import CausalLMLoss
from brrr.train.parallel.expert_parallel import (ExpertParallelMoE, LocalExperts, apply_expert_parallel,
                                                 sync_expert_parallel_grads)
from brrr.train.parallel.layout import Layout, check_model
from brrr.train.trainer import TrainConfig, Trainer
from tests import hf_models
from tests.train.conftest import TINY_MODEL
from tests.train.distributed_helpers import free_port, spawn, torchrun, train_losses

STEPS, BATCH, SEQ = 6, 4, 16


def _batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _train(model, rows, step_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn, losses = CausalLMLoss(model), []
    for batch in _batches():
        part = batch[rows]
        loss = loss_fn(part[:, :-1], part[:, 1:])
        opt.zero_grad()
        loss.backward()
        losses.append(step_fn(loss.detach()))
        opt.step()
    return losses


def _worker(rank, port, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = apply_expert_parallel(load_model(path, dtype=torch.float32).requires_grad_(True).train(),
                                      dist.group.WORLD)
        held = {n for n, _ in model.named_parameters() if ".experts." in n}

        def step(loss):
            sync_expert_parallel_grads(model, dist.group.WORLD)
            dist.all_reduce(loss)
            return loss.item() / 2

        losses = _train(model, slice(2 * rank, 2 * rank + 2), step)
        torch.save({"losses": losses, "held": sorted(held),
                    "params": {n: p.detach() for n, p in model.named_parameters()}}, f"{out}/rank{rank}.pt")
        assert all(isinstance(layer.mlp, ExpertParallelMoE) for layer in model.model.layers[1::2])
    finally:
        dist.destroy_process_group()


def test_two_expert_parallel_ranks_train_like_one_process(tmp_path):
    path = hf_models.save(hf_models.build("qwen3-moe-norm-topk"), tmp_path / "model")  # 4 experts, top 3
    one = load_model(path, dtype=torch.float32).requires_grad_(True).train()
    want = _train(one, slice(0, BATCH), lambda loss: loss.item())
    mp.start_processes(_worker, args=(free_port(), path, tmp_path), nprocs=2, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= 5e-5
    assert set(ranks[0]["held"]).isdisjoint(ranks[1]["held"])  # each expert lives on one rank
    full = dict(one.named_parameters())
    for r in ranks:  # replicated parameters and this rank's experts both end where the one-process run's do
        for name, p in r["params"].items():
            torch.testing.assert_close(p, full[name].detach(), atol=2e-5, rtol=1e-4, msg=name)
    assert len(ranks[0]["held"]) + len(ranks[1]["held"]) == sum(".experts." in n for n in full)


# no load-balancing loss: it is a product of means over each rank's own tokens, so data parallelism of any kind
# changes it (the next-token loss and the z-loss are means, which the ranks' average reproduces)
TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
            "router_aux_loss_coef": 0.0, "tie_word_embeddings": False}
LOSS_ATOL, WEIGHT_ATOL = 5e-5, 1e-4
GLOBAL_MICRO_BATCH = 4
TRAIN_STEPS = 10  # enough for warmup, clipping and a resume over three layouts; each step is a gloo round


def _cfg(model, data_dir, out, dp: int, **kw) -> TrainConfig:
    base = dict(device="cpu", seq_len=32, micro_batch=GLOBAL_MICRO_BATCH // dp, grad_accum=2, max_steps=TRAIN_STEPS,
                lr=3e-3, warmup_steps=2, eval_every=100, eval_windows=2, log_every=1, checkpoint_every=100,
                final_eval_windows=2, grad_clip=0.5)
    return TrainConfig(str(model), str(data_dir), str(out), **{**base, **kw})


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_runs")
    model = root / "config.json"
    model.write_text(json.dumps(TINY_MOE))
    outs = {name: root / name for name in ("single", "ep2", "ep2_fsdp2", "trip")}
    Trainer(_cfg(model, data_dir, outs["single"], 1)).run()
    spawn(4, [_cfg(model, data_dir, outs["ep2_fsdp2"], 4, ep=2, dp_shard=2),
              _cfg(model, data_dir, outs["trip"], 4, ep=2, dp_shard=2, stop_at=2)])
    spawn(2, [_cfg(model, data_dir, outs["ep2"], 2, ep=2),
              _cfg(model, data_dir, outs["trip"], 2, ep=2, resume=True, stop_at=4)])
    Trainer(_cfg(model, data_dir, outs["trip"], 1, resume=True)).run()
    return outs


@pytest.mark.parametrize("name", ["ep2", "ep2_fsdp2"])
def test_brrr_train_expert_parallel_matches_one_process(runs, name):
    ref, out = runs["single"], runs[name]
    logs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (ref / "train_log.jsonl").read_text().splitlines()]
    losses = train_losses(out)
    assert len(losses) == TRAIN_STEPS
    assert losses == pytest.approx(train_losses(ref), abs=LOSS_ATOL)
    # the clipped norm is the global one: the experts' share summed over the ep ranks
    norms = [r["grad_norm"] for r in logs if "grad_norm" in r]
    assert norms == pytest.approx([r["grad_norm"] for r in want if "grad_norm" in r], rel=1e-4)
    assert min(norms) > 0.5  # clipping acted on every step
    want_w, got_w = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert want_w.keys() == got_w.keys()  # the export gathers every rank's experts
    for key in want_w:
        torch.testing.assert_close(got_w[key], want_w[key], atol=WEIGHT_ATOL, rtol=0, msg=key)
    summary = json.loads((out / "train_summary.json").read_text())
    reference = json.loads((ref / "train_summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], abs=LOSS_ATOL)
    assert summary["tokens_seen"] == reference["tokens_seen"] == TRAIN_STEPS * 2 * GLOBAL_MICRO_BATCH * 32


def test_an_ep_checkpoint_resumes_on_other_layouts(runs):
    """Steps 1-2 on --ep 2 --dp-shard 2, 3-4 on --ep 2, 5-6 on one process: each rank's DCP entries are its own
    experts' (the optimizer's flattened per parameter), and the curve is the one-process one."""
    assert train_losses(runs["trip"]) == pytest.approx(train_losses(runs["single"]), abs=LOSS_ATOL)


def test_an_idle_local_expert_gets_a_zero_gradient():
    """FSDP's reduce-scatter over an expert's holders needs its gradient on every rank, pairs or none."""
    torch.manual_seed(0)
    experts = LocalExperts({"2": GatedMLP(8, 4), "3": GatedMLP(8, 4)})
    x, weight = torch.randn(5, 8), torch.rand(5)
    out = experts(x, torch.full((5,), 2), weight)
    out.sum().backward()
    mlp = experts["2"]
    torch.testing.assert_close(out, mlp(x) * weight[:, None])
    for p in experts["3"].parameters():
        assert p.grad is not None and not p.grad.any()
    assert all(p.grad.any() for p in mlp.parameters())


def test_layouts_expert_parallel_cannot_take_are_refused_by_flag():
    moe = ModelConfig.from_hf({**TINY_MOE, "vocab_size": 400})
    with pytest.raises(BrrrError, match="--ep 3 must divide the model's num_experts \\(4\\)"):
        check_model(Layout(dp_shard=1, ep=3), moe, 2, 32)
    with pytest.raises(BrrrError, match="--ep 2 splits the experts of MoE layers.*dense model"):
        check_model(Layout(dp_shard=1, ep=2), ModelConfig.from_hf({**TINY_MODEL, "vocab_size": 400}), 2, 32)
    for other in ({"tp": 2}, {"pp": 2}, {"cp": 2}):
        with pytest.raises(BrrrError, match="--ep 2 composes with --dp-shard and --dp-replicate; with --tp, --pp"):
            check_model(Layout(dp_shard=1, ep=2, **other), moe, 2, 32)
    with pytest.raises(BrrrError, match="x --ep 3 = 3 does not divide the world size 4"):
        Layout(ep=3).resolve(4)
    assert Layout(ep=2).resolve(8) == Layout(1, 4, 1, 1, 1, 2)
    assert Layout(ep=2).resolve(8).dp == 8  # the ep ranks read rows of their own


def test_torchrun_brrr_train_ep_on_a_dense_model_is_one_error_naming_the_flag(tiny_config, data_dir, tmp_path):
    flags = {"--config": tiny_config, "--data": data_dir, "--out": tmp_path / "out", "--device": "cpu",
             "--seq-len": 32, "--micro-batch": 2, "--max-steps": 2, "--ep": 2}
    proc = torchrun(2, [str(x) for kv in flags.items() for x in kv])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    message = "brrr: error: --ep 2 splits the experts of MoE layers; LlamaForCausalLM here is a dense model"
    assert err.count(message) == 1, err
