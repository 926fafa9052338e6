"""The rollout worker of GRPO: brrr's own engine, in the trainer's process, on the trainer's device, over the
trainer's model.

The engine's model IS the policy: EngineCore is built over the very module the optimizer updates, in its reference
form (pack_projections=False: no packed q/k/v or gate/up copies), so every parameter tensor is shared and AdamW's
in-place update is the weight sync: no copy, no disk (`sync_weights` checks that every tensor is still shared and
drops the prefix cache, whose K/V the old weights computed). With LoRA the adapters are modules of that same model.
A group is one request with n = num_generations (brrr/engine/forks.py: the prompt is prefilled once, the samples
fork its KV blocks); the engine returns each sampled token's log-probability (raw: the softmax of the logits).

Between rollouts the engine sleeps: the KV cache's tensors are freed for the train step (ModelRunner.sleep) and
reallocated after it (wake), with the prefix cache reset. CUDA graphs are off for the colocated engine: a graph
would replay into the freed cache. The batch_invariant knob will be passed through `engine_config` here.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from brrr.config import EngineConfig
from brrr.engine.core import EngineCore
from brrr.engine.llm_engine import LLMEngine
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams


class ColocatedRollout:
    def __init__(self, model: nn.Module, tokenizer, eos_token_ids, max_model_len: int, max_num_seqs: int,
                 **engine_config):
        config = EngineConfig(pack_projections=False, cuda_graphs=False, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, **engine_config)
        self.model = model
        was_training = model.training
        self.engine = LLMEngine(core=EngineCore(model, tokenizer, config, eos_token_ids))
        model.train(was_training)
        self.core = self.engine.core
        self._check_shared()
        self.asleep, self._counter = False, 0

    def _check_shared(self):
        mine = {n: p.data_ptr() for n, p in self.model.named_parameters()}
        theirs = {n: p.data_ptr() for n, p in self.core.model.named_parameters()}
        if mine != theirs:
            raise BrrrError("the rollout engine's model no longer shares the trainer's parameter tensors (a "
                            "serving transform replaced them), so in-place weight sync is impossible")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list:
        """One finished RequestOutput per prompt (its params' n samples), in order, all prompts batched together;
        the model runs in eval mode (no dropout) and returns to its mode after."""
        if self.asleep:
            raise BrrrError("the rollout engine is asleep: wake() it first")
        was_training = self.model.training
        self.model.eval()
        try:
            requests = []
            for p, sp in zip(prompts, params):
                self._counter += 1
                requests.append(self.engine.enqueue(self.core.make_request(f"rollout-{self._counter}", p, sp),
                                                    stream=False))
            done = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    done[out.request_id] = out
        finally:
            self.model.train(was_training)
        return [done[r.request_id] for r in requests]

    def sleep(self) -> int:
        """Free the KV cache; the bytes freed."""
        if self.engine.has_unfinished_requests():
            raise BrrrError("the rollout engine cannot sleep with requests running")
        self.asleep = True
        freed = self.core.runner.sleep()
        if torch.device(self.core.runner.device).type == "cuda":
            torch.cuda.empty_cache()  # back to the allocator's pool is not enough: the trainer may need it
        return freed

    def wake(self) -> None:
        self.core.runner.wake()
        self.core.block_manager.reset_prefix_cache()
        self.asleep = False

    def sync_weights(self) -> float:
        """The trained weights reach the engine: shared tensors, updated in place by the optimizer, so nothing is
        copied; the prefix cache (K/V of the old weights) is dropped. Returns the seconds it took."""
        start = time.perf_counter()
        self._check_shared()
        self.core.block_manager.reset_prefix_cache()
        return time.perf_counter() - start

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.core.runner.kv_caches for t in kv)
