"""brrr grpo on one CUDA GPU: a LoRA GRPO run over a bf16 base rolls out through the colocated engine, the KV
cache's memory goes back to the allocator while the engine sleeps and returns on wake, and after a train step the
engine's log-probs of its own tokens agree with the trainer's recomputation (bf16, so within a tolerance; the
measured mismatch is logged every step)."""
import json

import pytest
import torch

from brrr.sampling_params import SamplingParams
from brrr.train.completion_batch import completion_logprobs
from brrr.train.grpo import GRPOConfig, GRPOTask
from brrr.train.rewards import Rewards
from brrr.train.trainer import Trainer
from tests.hf_models import build, save, save_tokenizer

pytestmark = pytest.mark.gpu


def share_low(prompts, completions, completion_ids, **kw):
    return [sum(t < 32 for t in c) / len(c) for c in completion_ids]


def test_lora_grpo_on_cuda(tmp_path):
    path = save_tokenizer(save(build("llama3-rope", vocab_size=320), tmp_path / "model"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(8)))
    cfg = GRPOConfig(str(path), str(prompts), str(tmp_path / "out"), reward=["custom"], num_generations=8,
                     micro_batch=16, max_completion_length=16, max_steps=3, lr=1e-3, log_every=1, use_peft=True,
                     lora_r=8, lora_dropout=0.0, device="cuda")
    task = GRPOTask(cfg.task, Rewards([share_low]))
    trainer = Trainer(cfg, task)
    kv = task.engine.kv_cache_bytes()
    trainer.run()
    assert task.engine.asleep and task.engine.kv_cache_bytes() == 0
    asleep = torch.cuda.memory_allocated()
    task.engine.sync_weights()
    task.engine.wake()
    assert torch.cuda.memory_allocated() - asleep >= kv
    out = task.engine.generate([task.prompt_ids[0]], [SamplingParams(n=2, max_tokens=16, logprobs=0, seed=3)])[0]
    tokens = [list(s.token_ids) for s in out.outputs]
    engine = [torch.tensor([next(iter(e.values())) for e in s.logprobs]) for s in out.outputs]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        mine = completion_logprobs(task.model, [task.prompt_ids[0]] * 2, tokens, "cuda").float().cpu()
    for e, m, t in zip(engine, mine, tokens):
        assert (e - m[:len(t)]).abs().max() < 0.1
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines() if '"reward"' in x]
    assert all(r["kv_cache_freed_bytes"] == kv and r["logprob_mismatch/max"] < 0.5 for r in log)


def test_full_parameter_grpo_syncs_a_bf16_copy(tmp_path):
    """fp32 master weights roll out from the engine's bf16 packed copy; each step's sync copies them in (timed)."""
    path = save_tokenizer(save(build("llama3-rope", vocab_size=320), tmp_path / "model"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(8)))
    cfg = GRPOConfig(str(path), str(prompts), str(tmp_path / "out"), reward=["custom"], num_generations=8,
                     micro_batch=16, max_completion_length=16, max_steps=3, lr=1e-3, log_every=1, device="cuda")
    task = GRPOTask(cfg.task, Rewards([share_low]))
    Trainer(cfg, task).run()
    assert not task.engine.shared and next(task.engine.core.model.parameters()).dtype == torch.bfloat16
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines() if '"reward"' in x]
    assert all(r["weight_sync_s"] > 0 and r["logprob_mismatch/max"] < 0.5 for r in log[1:])
