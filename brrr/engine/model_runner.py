"""ModelRunner: owns the paged KV cache and turns a scheduled step into one flattened varlen forward pass."""
from __future__ import annotations

import torch

from brrr.analysis.model import kv_elements_per_token
from brrr.engine.sampler import SampleResult, SampleRow, sample
from brrr.engine.scheduler import ScheduledBatch
from brrr.kernels import AttnMeta


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens (the count lives in brrr.analysis, with every other)."""
    return block_size * kv_elements_per_token(cfg) * dtype.itemsize


class ModelRunner:
    def __init__(self, model, block_size: int, num_blocks: int):
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]

    @staticmethod
    @torch.inference_mode()
    def profile_num_blocks(model, block_size: int, max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:
        """CUDA: run one forward at the full token budget, then give the KV cache what is left of
        total * utilization after the weights and that peak."""
        device = next(model.parameters()).device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        n = max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=device)
        model.compute_logits(model(ids, torch.arange(n, device=device), AttnMeta.causal([n], device))[-256:])
        torch.cuda.synchronize(device)
        total = torch.cuda.get_device_properties(device).total_memory
        free_for_kv = total * gpu_memory_utilization - torch.cuda.max_memory_allocated(device)
        per_block = kv_bytes_per_block(model.config, block_size, next(model.parameters()).dtype)
        return int(free_for_kv // per_block)

    def _copy_blocks(self, copies):
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[tuple[int, SampleRow]],
                logit_rows: list[int] = ()) -> tuple[SampleResult, torch.Tensor | None]:
        """Run one step. sample_rows: (row of the flattened batch, how to sample it); logit_rows: extra rows whose
        log-probabilities the caller wants (prompt_logprobs). Returns the samples and those log-probs."""
        self._copy_blocks(batch.copies)
        bs, dev = self.block_size, self.device
        ids, positions, slots, seqlens, context_lens = [], [], [], [], []
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [seq.block_table[p // bs] * bs + p % bs for p in pos]
            seqlens.append(n)
            context_lens.append(start + n)
        width = max(len(seq.block_table) for seq, _ in batch.items)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch.items],
                              dtype=torch.int32)
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        meta = AttnMeta(cu_seqlens_q=cu.to(dev), seqlens_q=seqlens, context_lens=context_lens,
                        slot_mapping=torch.tensor(slots, device=dev), block_tables=tables.to(dev),
                        kv_caches=self.kv_caches)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta)
        rows = [r for r, _ in sample_rows]
        logits = self.model.compute_logits(hidden[rows + list(logit_rows)])
        result = sample(logits[: len(rows)], [row for _, row in sample_rows])
        extra = logits[len(rows):].log_softmax(-1) if logit_rows else None
        return result, extra
