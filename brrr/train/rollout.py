"""The rollout worker of GRPO: brrr's own engine, in the trainer's process, on the trainer's device.

Two ways for the trainer's weights to reach it, neither through the disk:
- shared (LoRA adapters, and any policy whose weights the engine can run as they are): EngineCore is built over
  the very module the optimizer updates, in its reference form (pack_projections=False: no packed q/k/v or gate/up
  copies), so every parameter tensor is shared and AdamW's in-place update is the sync; `sync_weights` checks that
  the tensors are still shared and drops the prefix cache, whose K/V the old weights computed. With LoRA the
  adapters are modules of that same model.
- copied (a full-parameter policy on CUDA: fp32 master weights): the engine holds its own serving form, bf16 with
  packed projections, and `sync_weights` copies each trained tensor into it in place (into its slice of a packed
  projection: `brrr.state_dict.hf_state_dict` gives those as views), timed.
A group is one request with n = num_generations (brrr/engine/forks.py: the prompt is prefilled once, the samples
fork its KV blocks); the engine returns each sampled token's log-probability (raw: the softmax of the logits).

Between rollouts the engine sleeps: the KV cache's tensors are freed for the train step (ModelRunner.sleep) and
reallocated after it (wake), with the prefix cache reset. The decode CUDA graphs hold the cache's addresses: sleep
drops them (their memory pool too) and wake captures them again over the new cache (ModelRunner.wake), a cost
wake_s shows against the rollout's eager launches it saves. Engine options (batch_invariant: brrr grpo --batch-invariant) pass through
`engine_config`.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from brrr.config import EngineConfig
from brrr.engine.core import EngineCore
from brrr.engine.llm_engine import LLMEngine
from brrr.errors import BrrrError
from brrr.sampling_params import SamplingParams
from brrr.state_dict import hf_state_dict


class ColocatedRollout:
    def __init__(self, model: nn.Module, tokenizer, eos_token_ids, max_model_len: int, max_num_seqs: int,
                 copy_dtype: torch.dtype | None = None, **engine_config):
        """copy_dtype: give the engine its own serving form in this dtype, synced by copying (None: share the
        trainer's tensors)."""
        self.model, self.shared = model, copy_dtype is None
        was_training = model.training
        served = model
        if not self.shared:
            served = copy.deepcopy(model).to(copy_dtype).requires_grad_(False).eval()
        config = EngineConfig(pack_projections=False if self.shared else engine_config.pop("pack_projections", None),
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              **engine_config)
        self.engine = LLMEngine(core=EngineCore(served, tokenizer, config, eos_token_ids))
        model.train(was_training)
        self.core = self.engine.core
        if self.shared:
            self._check_shared()
        else:  # trainer tensor -> the engine's tensor (a view into a packed projection) it is copied into
            theirs, mine = hf_state_dict(self.core.model), hf_state_dict(model)
            missing = sorted(set(mine) - set(theirs))
            if missing:
                raise BrrrError(f"the rollout engine's serving form has no tensor for {', '.join(missing[:3])}")
            self._pairs = [(mine[n], theirs[n]) for n in mine]
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
        was_training = self.model.training
        self.model.eval()  # the graphs captured again here must not hold a training forward (dropout)
        try:
            self.core.runner.wake()
        finally:
            self.model.train(was_training)
        self.core.block_manager.reset_prefix_cache()
        self.asleep = False

    @torch.no_grad()
    def sync_weights(self) -> float:
        """The trained weights reach the engine (shared: nothing to copy; else each tensor copied in place), and
        the prefix cache (K/V of the old weights) is dropped. Returns the seconds it took."""
        start = time.perf_counter()
        if self.shared:
            self._check_shared()
        else:
            for src, dst in self._pairs:
                dst.copy_(src)
            if torch.device(self.core.runner.device).type == "cuda":
                torch.cuda.synchronize(self.core.runner.device)
        self.core.block_manager.reset_prefix_cache()
        return time.perf_counter() - start

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.core.runner.kv_caches for t in kv)
