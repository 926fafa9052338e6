"""Expert parallelism under gloo: 2 ranks, each holding half the experts and half of every batch, train 10 steps
with the one-process run's losses (within 5e-5) and parameters."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from brrr import load_model
from brrr.train.loss import CausalLMLoss
from brrr.train.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel, sync_expert_parallel_grads
from tests import hf_models
from tests.train.distributed_helpers import free_port

STEPS, BATCH, SEQ = 10, 4, 16


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
