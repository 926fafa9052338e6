"""Training arithmetic: per-GPU memory (state + activations), communication per step, pipeline bubble, step time, MFU.

Parallelism: gpus = dp * tp * pp. Tensor parallelism (Megatron, with sequence parallelism) splits weights and
activations tp ways; pipeline parallelism splits layers pp ways, balancing compute (`stage_layers`: the last
stage also runs the LM head, so it takes fewer layers); data parallelism replicates the rest, and ZeRO shards
optimizer state (stage 1), + gradients (2), + weights (3) across the dp replicas. Mixed-precision Adam keeps 16
bytes per parameter. The ZeRO paper's table (`training_state_bytes`) splits them bf16 weights 2 + bf16 gradients 2 +
fp32 master, m, v 12; `train_plan`'s memory is what PyTorch mixed precision (brrr train) holds: fp32 master weights
4, fp32 gradients 4 and Adam's m and v 8, with the bf16 compute copies of the weights counted apart, only while a
step uses them, and the peak taken over the two moments it can fall at (`trainer_memory`), on the pipeline rank
where it is largest.

Expert parallelism (ep, an MoE model's routed experts split over ep of the dp ranks, brrr train's --ep): each rank
holds E / ep experts of every MoE layer, so their state is divided by ep and (with ZeRO) sharded over the dp / ep
ranks that hold the same experts, while the dense weights shard over all dp ranks. Every MoE layer sends each
token's k routed copies of its hidden state to the experts' ranks and back (dispatch and combine, two all-to-alls
a pass; forward, backward and checkpointing's recompute are passes), (ep - 1) / ep of them leaving the GPU; the
all-to-alls wait for the router and the experts wait for them, so their time is counted on the critical path.
"""
from __future__ import annotations

from brrr.analysis.hardware import GPU
from brrr.analysis.model import (is_mla, matmul_params, mlp_width_per_token, moe_layers, param_counts,
                                 prefill_flops_per_token, qk_v_head_dims, training_flops_per_token)
from brrr.analysis.serve import allreduce_seconds
from brrr.config import ModelConfig
from brrr.errors import BrrrError

STATE_BYTES_PER_PARAM = {"params": 2, "grads": 2, "optimizer": 12}
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# The chunked linear cross-entropy (brrr/train/loss.py) takes the logits this many fp32 bytes of them at a time:
# rows enough for full-width LM-head matmuls, small beside the model
LOSS_CHUNK_LOGIT_BYTES = 1 << 29


def loss_chunk_rows(vocab: int) -> int:
    """Tokens per chunk of the chunked loss: LOSS_CHUNK_LOGIT_BYTES of fp32 logits, a multiple of 128 (1024 at a
    128k vocabulary)."""
    rows = LOSS_CHUNK_LOGIT_BYTES // (4 * vocab)
    return max(128, rows // 128 * 128)


def loss_bytes(cfg: ModelConfig, tokens: int, tp: int = 1, head_trains: bool = True) -> dict:
    """What the next-token loss adds at the end of forward. Chunked (tp = 1): one chunk's bf16 logits and their
    bf16 gradient (4 bytes x vocab x rows: on CUDA the fp32 math between them is fused, never stored), and the
    gradients it computed for backward: the hidden states' (bf16, 2h per token) and, when the head trains, the head's
    weight (bf16, vocab x hidden). Vocabulary-parallel under TP (eager): 16 bytes x vocab / tp per token at its peak,
    the start of its backward: the saved fp32 log-softmax, and the fp32 gradient and two fp32 temporaries torch's
    nll/log-softmax backward allocates (an H100 allocation trace of llama-3.2-1b under FSDP2 x TP 2 showed these
    four buffers)."""
    v, h = cfg.vocab_size, cfg.hidden_size
    if tp > 1:
        return {"transient": 16.0 * v * tokens / tp, "gradients": 0.0}
    return {"transient": 4.0 * v * min(tokens, loss_chunk_rows(v)),
            "gradients": 2.0 * h * tokens + (2.0 * v * h if head_trains else 0.0)}


def training_state_bytes(params: float, dp: int, zero: int = 0, model_parallel: int = 1) -> dict:
    """Per-GPU bytes of weights, gradients and optimizer state for `params` parameters split model_parallel
    (tp * pp) ways, with ZeRO stage `zero` sharding across the dp data-parallel replicas."""
    if zero not in (0, 1, 2, 3):
        raise BrrrError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    local = params / model_parallel
    shard = {"params": dp if zero >= 3 else 1, "grads": dp if zero >= 2 else 1, "optimizer": dp if zero >= 1 else 1}
    out = {k: local * STATE_BYTES_PER_PARAM[k] / shard[k] for k in STATE_BYTES_PER_PARAM}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_token_per_layer(cfg: ModelConfig) -> float:
    """Bytes one layer saves for backward per token, bf16, flash attention (no seq x seq matrix), SwiGLU:
    norm inputs (2h each) + fp32 rstd (4 each), the normed inputs of the q/k/v and gate/up projections (2h each),
    q, k, v and the attention output (2 bytes per element) + fp32 log-sum-exp per head, and in the MLP the gate
    and up outputs, silu(gate) and the down projection's input (4 x 2 bytes x width). MoE adds the router's fp32
    logits and one copy of the token's input per routed expert; MLA its latents; qk-norm the pre-norm q and k."""
    h, nh = cfg.hidden_size, cfg.num_heads
    d_qk, d_v = qk_v_head_dims(cfg)
    kv_heads = nh if is_mla(cfg) else cfg.num_kv_heads
    attn = 2 * nh * d_qk + 2 * kv_heads * (d_qk + d_v) + 2 * nh * d_v + 4 * nh
    if is_mla(cfg):
        attn += 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.kv_lora_rank + 4 * cfg.q_lora_rank
    if cfg.qk_norm:
        attn += 2 * (nh + kv_heads) * d_qk
    mlp = 8 * mlp_width_per_token(cfg)
    if cfg.num_experts:
        mlp += 4 * cfg.num_experts + 2 * h * cfg.num_experts_per_tok
    return 2 * (2 * h + 4) + 2 * (2 * h) + attn + mlp


def pipeline_bubble(stages: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> dict:
    """Idle fraction of a pipeline step. GPipe and 1F1B both idle (p - 1) microbatch-slots per stage out of
    m + p - 1; interleaved 1F1B with v model chunks per GPU shrinks each slot v-fold: (p - 1) / (v m + p - 1).
    `overhead` is bubble time over ideal compute time, (p - 1) / (v m) (Narayanan et al., 2021)."""
    if schedule not in SCHEDULES:
        raise BrrrError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise BrrrError(f"--pp ({stages}), --microbatches ({microbatches}) and --chunks ({chunks}) must be >= 1")
    if schedule != "interleaved" and chunks != 1:
        raise BrrrError(f"--chunks {chunks} needs --schedule interleaved")
    v = chunks if schedule == "interleaved" else 1
    slots = v * microbatches
    return {"fraction": (stages - 1) / (slots + stages - 1), "overhead": (stages - 1) / slots}


def in_flight_microbatches(stages: int, microbatches: int, schedule: str, chunks: int = 1, rank: int = 0) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak (in units of all its layers): GPipe all
    m; 1F1B min(m, p - rank) (its warm-up forwards and the first steady one); interleaved 1F1B's warm-up holds
    2 (p - rank - 1) + (v - 1) p + 1 chunks, each 1/v of the rank's layers (Megatron's schedule, which PyTorch's
    follows)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved":
        return min(chunks * microbatches, 2 * (stages - rank - 1) + (chunks - 1) * stages + 1) / chunks
    return min(microbatches, stages - rank)


def head_layers(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> float:
    """The LM head's training FLOPs in layers' worth: what the last pipeline stage runs beside its layers (a
    128k-vocabulary head is 3.8 llama-3.2-1b layers at 4,096 tokens, 2.2 llama-3.1-8b layers). Recomputation
    repeats the layers' forward, not the head's."""
    head = 2 * cfg.vocab_size * cfg.hidden_size
    per_layer = (prefill_flops_per_token(cfg, seq_len) - head) / cfg.num_layers * (4 / 3 if recompute else 1)
    return head / per_layer


def stage_layers(num_layers: int, stages: int, head: float = 0.0) -> list[list[int]]:
    """Consecutive layers per pipeline stage, the busiest stage as light as it can be: the last stage's cost is its
    layers + `head` (head_layers), the others share the remaining layers evenly (the remainder one each to the
    first). Of equally busy splits, the one with the most layers on the last stage (the first holds the most
    microbatches' activations)."""
    if stages == 1:
        return [list(range(num_layers))]

    def counts(last: int) -> list[int]:
        base, extra = divmod(num_layers - last, stages - 1)
        return [base + (s < extra) for s in range(stages - 1)] + [last]

    best = min(range(1, num_layers - stages + 2),
               key=lambda last: (max(max(counts(last)[:-1]), last + head), -last))
    out, start = [], 0
    for n in counts(best):
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_stages(pp: int, chunks: int = 1) -> list[list[int]]:
    """The stages each pipeline rank holds: rank r holds r, r + pp, ... (interleaved 1F1B's looped placement)."""
    return [[r + k * pp for k in range(chunks)] for r in range(pp)]


def stage_imbalance(split: list[list[int]], pp: int, chunks: int = 1, head: float = 0.0) -> float:
    """The busiest pipeline rank's compute over the mean rank's under a split of stage_layers' (1: balanced); the
    pipeline runs at the busiest rank's pace."""
    last = len(split) - 1
    cost = [sum(len(split[s]) + (head if s == last else 0) for s in ids) for ids in rank_stages(pp, chunks)]
    return max(cost) * pp / sum(cost)


def trainer_memory(dp: int, zero: int, local: float, root: float, layer: float, activations: float, loss: dict,
                   pipeline: bool = False) -> dict:
    """Per-GPU bytes brrr's trainer holds on one rank, at the larger of its two peaks (`peak`: which one). local:
    the rank's parameters (after TP and PP); root: those outside the layers it holds (embedding, LM head); layer:
    one layer's on the rank; pipeline: a pipeline's microbatches have accumulated gradients by the forward peak
    (1F1B, interleaved).

    State, PyTorch mixed precision: fp32 master weights 4, fp32 gradients 4, Adam m and v 8 bytes per parameter;
    ZeRO-1 shards Adam's, ZeRO-2 also the gradients and master weights, ZeRO-3 (FSDP2 resharding after forward) is
    ZeRO-2 that also frees the gathered weights between uses. working_weights, the bf16 copies compute reads: every
    weight from forward to backward with autocast (one process, DDP) and FSDP2's ZeRO-2; with ZeRO-3 only the root
    group's (embedding, LM head: FSDP2 keeps the root gathered through backward) and two layers' (the one computing
    and the one prefetched). DDP adds its gradient buckets (fp32, every parameter once).
    End of forward: weights, Adam, working copies, the activations and the loss (its chunk and the gradients it
    computed); gradients are not there yet (zero_grad frees them), except with a pipeline, whose microbatches
    accumulate them through the step: under FSDP2 unsharded, in fp32, with the bf16 weights kept gathered
    (torch.distributed.pipelining turns gradient sync and resharding after backward off until the last
    microbatch). End of backward: every gradient, and under FSDP2 the root group's last
    reduce-scatter: its bf16 gradients and their fp32 copy to reduce (the root's gathered weights are freed first)."""
    params = 4 * local / (dp if zero >= 2 else 1)
    grads = 4 * local / (dp if zero >= 2 else 1)
    optimizer = 8 * local / (dp if zero >= 1 else 1)
    working = 2 * (root + 2 * layer) if zero >= 3 and not pipeline else 2 * local
    buckets = 4 * local if zero == 0 and dp > 1 else 0.0
    reduce_scatter = (2 + 4) * root if zero >= 2 and dp > 1 else 0.0
    held = params + optimizer + buckets
    loss_total = loss["transient"] + loss["gradients"]
    accumulated = (4 * local if zero >= 2 else grads) if pipeline else 0.0
    forward = held + working + accumulated + activations + loss_total
    backward = held + grads + reduce_scatter
    return {"params": params, "grads": grads, "optimizer": optimizer, "working_weights": working,
            "ddp_buckets": buckets, "activations": activations, "loss": loss_total, "reduce_scatter": reduce_scatter,
            "end_of_forward": forward, "end_of_backward": backward,
            "peak": "end of forward" if forward >= backward else "end of backward", "total": max(forward, backward)}


# The fraction of the bf16 peak that training's matmuls reach when nothing is assumed: large, well-tuned bf16 runs
# report 38-43% MFU (Llama 3 on 16k H100s); 1.0 gives the roofline, what the layout alone costs.
TYPICAL_EFFICIENCY = 0.4


def all_to_all_bytes(cfg: ModelConfig, tokens: int, ep: int) -> float:
    """Bytes one GPU sends in one pass (a forward, or a backward) of an MoE model's all-to-alls over ep ranks: per
    MoE layer, dispatch and combine each move its tokens' k routed copies of the hidden state (bf16), of which
    (ep - 1) / ep go to other ranks (routing spread evenly)."""
    if ep == 1:
        return 0.0
    return 2 * moe_layers(cfg) * tokens * cfg.num_experts_per_tok * cfg.hidden_size * 2 * (ep - 1) / ep


def _check_ep(cfg: ModelConfig, ep: int, dp: int, tp: int, pp: int) -> None:
    if ep < 1:
        raise BrrrError(f"--ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if not cfg.num_experts:
        raise BrrrError(f"--ep {ep} needs an MoE model; {cfg.architecture} has no experts")
    if cfg.num_experts % ep:
        raise BrrrError(f"--ep {ep} must divide the number of experts ({cfg.num_experts})")
    if dp % ep:
        raise BrrrError(f"--ep {ep} must divide the data-parallel ranks (--gpus / (--tp x --pp) = {dp})")
    if tp > 1 or pp > 1:  # as brrr train: expert parallelism composes with data parallelism (FSDP2) only
        raise BrrrError(f"--ep {ep} does not combine with --tp or --pp (brrr train refuses them together)")


def train_plan(cfg: ModelConfig, gpu: GPU, gpus: int = 8, zero: int = 0, tp: int = 1, pp: int = 1,
               micro_batch: int = 1, seq_len: int = 4096, microbatches: int | None = None,
               checkpointing: bool = False, schedule: str = "1f1b", chunks: int = 1, gpus_per_node: int = 8,
               network_bandwidth: float = 50e9, efficiency: float = TYPICAL_EFFICIENCY, ep: int = 1) -> dict:
    """Per-GPU memory, communication, bubble and roofline step time / MFU of one optimizer step.
    network_bandwidth (bytes/s per GPU, one direction) is used for data-parallel traffic across nodes; 50e9 is
    an assumed 400 Gb/s InfiniBand NIC per GPU. `efficiency` is the fraction of the bf16 peak the matmuls
    reach (TYPICAL_EFFICIENCY by default; 1.0: the roofline bound; a measured GPU's peak is already its measured
    matmul rate)."""
    if gpus < 1 or tp < 1 or pp < 1 or gpus % (tp * pp):
        raise BrrrError(f"--gpus ({gpus}) must be a positive multiple of --tp x --pp ({tp} x {pp})")
    if cfg.num_heads % tp:
        raise BrrrError(f"--tp {tp} must divide num_attention_heads ({cfg.num_heads})")
    if pp > cfg.num_layers:
        raise BrrrError(f"--pp {pp} must be <= num_hidden_layers ({cfg.num_layers})")
    if micro_batch < 1 or seq_len < 1:
        raise BrrrError(f"--micro-batch ({micro_batch}) and --seq-len ({seq_len}) must be >= 1")
    if zero not in (0, 1, 2, 3):
        raise BrrrError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    dp = gpus // (tp * pp)
    _check_ep(cfg, ep, dp, tp, pp)
    m = microbatches if microbatches is not None else (4 * pp if pp > 1 else 1)
    bubble = pipeline_bubble(pp, m, schedule, chunks)
    if schedule == "interleaved" and m % pp:
        raise BrrrError(f"--schedule interleaved needs --microbatches ({m}) to be a multiple of --pp ({pp})")
    h = cfg.hidden_size
    counts = param_counts(cfg)
    params = counts["total"]

    # pipeline ranks: stage_layers' split (the last stage's head weighed in), each rank's layers and parameters;
    # the first rank holds the embedding and the most microbatches in flight, the last the head and the loss
    head = head_layers(cfg, seq_len, checkpointing)
    split = stage_layers(cfg.num_layers, pp * chunks, head)
    layer_params = (params - counts["embedding"] - counts["head"]) / cfg.num_layers
    rank_layers = [sum(len(split[s]) for s in ids) for ids in rank_stages(pp, chunks)]
    imbalance = stage_imbalance(split, pp, chunks, head)

    # activations: layers of this rank x microbatches in flight; with checkpointing only each layer's input
    # stays, and backward rematerializes one layer at a time
    tokens_mb = micro_batch * seq_len
    full_layer = activation_bytes_per_token_per_layer(cfg) * tokens_mb / tp
    kept_layer = 2 * h * tokens_mb / tp if checkpointing else full_layer
    rematerialized = full_layer if checkpointing else 0.0

    def held_activations(rank: int) -> float:
        return in_flight_microbatches(pp, m, schedule, chunks, rank) * rank_layers[rank] * kept_layer + rematerialized

    loss = loss_bytes(cfg, tokens_mb, tp)
    if pp > 1 and schedule == "gpipe":  # the last stage runs every microbatch's forward (and loss) before backward
        loss["gradients"] *= m
    if pp == 1 and ep > 1:  # the dense weights over all dp ranks, each rank's experts over the dp / ep holding them
        experts = counts["routed_experts"]
        dense = trainer_memory(dp, zero, params - experts, counts["embedding"] + counts["head"],
                               layer_params - experts / cfg.num_layers, held_activations(0), loss)
        local = trainer_memory(dp // ep, zero, experts / ep, 0.0, experts / moe_layers(cfg) / ep, 0.0,
                               {"transient": 0.0, "gradients": 0.0})
        memory = {k: v + local[k] if k != "peak" else v for k, v in dense.items() if k != "total"}
        memory["peak"] = "end of forward" if memory["end_of_forward"] >= memory["end_of_backward"] else \
            "end of backward"
        memory["total"] = max(memory["end_of_forward"], memory["end_of_backward"])
    elif pp == 1:
        memory = trainer_memory(dp, zero, params / tp, (counts["embedding"] + counts["head"]) / tp, layer_params / tp,
                                held_activations(0), loss)
    else:  # the larger of the first and the last rank (a tied head is a copy of the embedding there); 1F1B's peak
        # recurs after backwards began, GPipe's (the end of its forwards) comes before any
        nothing, accumulating = {"transient": 0.0, "gradients": 0.0}, schedule != "gpipe"
        first = trainer_memory(dp, zero, (counts["embedding"] + rank_layers[0] * layer_params) / tp,
                               counts["embedding"] / tp, layer_params / tp, held_activations(0), nothing,
                               pipeline=accumulating)
        head_params = counts["head"] or counts["embedding"]
        last = trainer_memory(dp, zero, (head_params + rank_layers[-1] * layer_params) / tp, head_params / tp,
                              layer_params / tp, held_activations(pp - 1), loss, pipeline=accumulating)
        memory = {**max(first, last, key=lambda r: r["total"]),
                  "rank": "first stage" if first["total"] >= last["total"] else "last stage"}

    # communication per GPU per step (bytes sent; a ring moves (n-1)/n of the buffer per GPU per pass)
    def data_parallel_bytes(local: float, ranks: int) -> float:
        ring = (ranks - 1) / ranks
        if zero <= 1:  # one bf16 gradient all-reduce (ZeRO-1: reduce-scatter + all-gather, same bytes)
            return 2 * ring * 2 * local
        if zero == 2:  # gradients reduce-scattered every microbatch, updated weights all-gathered once
            return (m + 1) * ring * 2 * local
        return 3 * m * ring * 2 * local  # weights gathered for forward and backward, gradients reduce-scattered

    if ep > 1:  # the dense weights' traffic over every dp rank, the experts' over the dp / ep holding the same ones
        dp_bytes = data_parallel_bytes(params - counts["routed_experts"], dp) + (
            data_parallel_bytes(counts["routed_experts"] / ep, dp // ep) if dp > ep else 0.0)
    else:
        dp_bytes = data_parallel_bytes(params / (tp * pp), dp)
    passes = 3 if checkpointing else 2  # forward, backward (and the recompute's forward)
    a2a_forward = all_to_all_bytes(cfg, tokens_mb, ep)
    ep_bytes = passes * m * a2a_forward
    tp_collectives = (6 if checkpointing else 4) * max(rank_layers) * m if tp > 1 else 0
    tp_buffer = tokens_mb * h * 2
    tp_bytes = tp_collectives * 2 * (tp - 1) / tp * tp_buffer
    pp_bytes = 2 * m * chunks * tokens_mb * h * 2 / tp if pp > 1 else 0

    # time: FLOPs at efficiency x the GPU's bf16 peak, stretched by the bubble and by the busiest pipeline rank's
    # excess; TP collectives sit on the critical path; DP traffic overlaps backward (ZeRO-3: forward too) and only
    # its excess shows
    tokens = tokens_mb * m * dp
    model_flops = training_flops_per_token(cfg, seq_len) * tokens
    hardware_flops = training_flops_per_token(cfg, seq_len, recompute=checkpointing) * tokens
    if not 0 < efficiency <= 1:
        raise BrrrError(f"--efficiency must be in (0, 1], got {efficiency}")
    peak = gpu.peak("bf16") * efficiency
    compute_s = hardware_flops / (gpus * peak)
    pipeline_s = compute_s * imbalance / (1 - bubble["fraction"])
    tp_s = tp_collectives * allreduce_seconds(tp_buffer, tp, gpu)
    dp_link = gpu.link_bandwidth if gpus <= gpus_per_node else network_bandwidth
    dp_s = dp_bytes / dp_link if dp > 1 else 0.0
    overlap_s = compute_s if zero == 3 else compute_s * (hardware_flops - model_flops / 3) / hardware_flops
    ep_s = ep_bytes / (gpu.link_bandwidth if ep <= gpus_per_node else network_bandwidth)
    step_s = pipeline_s + tp_s + ep_s + max(0.0, dp_s - overlap_s)
    return {
        "gpu": gpu.name, "gpus": gpus, "dp": dp, "tp": tp, "pp": pp, "ep": ep, "zero": zero,
        "micro_batch": micro_batch,
        "seq_len": seq_len, "microbatches": m, "schedule": schedule, "chunks": chunks,
        "checkpointing": checkpointing, "efficiency": efficiency, "params": params, "tokens_per_step": tokens,
        "memory": {**memory, "gpu_memory": gpu.memory, "fits": memory["total"] <= gpu.memory},
        "communication_bytes": {"data_parallel": dp_bytes, "tensor_parallel": tp_bytes, "pipeline": pp_bytes,
                                "expert_parallel": ep_bytes},
        "all_to_all_bytes_per_forward": a2a_forward,
        "bubble": bubble, "stage_layers": [len(x) for x in split], "stage_imbalance": imbalance,
        "flops": {"model": model_flops, "hardware": hardware_flops,
                  "per_token": training_flops_per_token(cfg, seq_len),
                  "six_n_per_token": 6 * matmul_params(cfg),
                  "attention_per_token": 3 * (prefill_flops_per_token(cfg, seq_len) - 2 * matmul_params(cfg))},
        "time": {"compute_s": compute_s, "pipeline_s": pipeline_s, "tensor_parallel_s": tp_s,
                 "data_parallel_s": dp_s, "data_parallel_exposed_s": max(0.0, dp_s - overlap_s),
                 "expert_parallel_s": ep_s, "step_s": step_s},
        "tokens_per_s": tokens / step_s, "mfu": model_flops / (step_s * gpus * gpu.datasheet_peak("bf16")),
    }
