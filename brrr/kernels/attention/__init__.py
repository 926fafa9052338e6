"""Causal attention over a flattened varlen batch, optionally through a paged KV cache.

meta.py (AttnMeta: what a step tells attention), reference.py (plain torch), op.py (`attention`, the dispatcher),
plan.py (every kernel selection rule: `decode_plan`, the graphs a capture needs, prefill tiles), and the Triton
kernels: kv_write.py, prefill.py, decode.py (split-KV), lean.py and lean_mma.py (batch-small decodes), with the
helpers they share in helpers.py.
"""
from brrr.kernels.attention.decode import decode_attention_triton
from brrr.kernels.attention.kv_write import write_kv_triton
from brrr.kernels.attention.meta import AttnMeta
from brrr.kernels.attention.op import attention, attention_triton
from brrr.kernels.attention.plan import DecodePlan, decode_graph_plans, decode_plan, graph_plan_for
from brrr.kernels.attention.prefill import prefill_attention_triton
from brrr.kernels.attention.reference import attention_ref, paged_decode_ref, write_kv_ref

__all__ = ["AttnMeta", "DecodePlan", "attention", "attention_ref", "attention_triton", "decode_attention_triton",
           "decode_graph_plans", "decode_plan", "graph_plan_for", "paged_decode_ref", "prefill_attention_triton",
           "write_kv_ref", "write_kv_triton"]
