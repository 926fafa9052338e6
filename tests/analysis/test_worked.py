"""Worked answers derived by hand (each derivation in the comment above its asserts)."""
import dataclasses

import pytest

from brrr.analysis.formats import weight_format
from brrr.analysis.hardware import get_gpu
from brrr.analysis.model import (compute_bound_batch, param_counts, decode_bytes_per_step,
                                 decode_weight_bytes, experts_touched, flops_per_token, kv_bytes_per_sequence,
                                 kv_bytes_per_token, prefill_flops)
from brrr.analysis.roofline import matmul, place, transformer_ops
from brrr.analysis.serve import decode_step, serve_plan, ttft
from brrr.analysis.train import (activation_bytes_per_token_per_layer, head_layers, in_flight_microbatches,
                                 pipeline_bubble, train_plan, training_state_bytes)
from brrr.errors import BrrrError
from brrr.presets import preset_config

GiB = 2**30


def test_llama2_70b_kv_cache_mha_vs_gqa():
    # Llama-2-70B shape: 80 layers, 64 heads, head dim 128. With MHA every head has its own K and V:
    #   per token = layers x 2 (K and V) x kv_heads x head_dim x 2 bytes (bf16)
    #             = 80 x 2 x 64 x 128 x 2 = 2,621,440 bytes (2.5 MiB)
    #   8,192 tokens, batch 1: 2,621,440 x 8,192 = 21,474,836,480 bytes = 20 GiB
    mha = dataclasses.replace(preset_config("llama-2-70b"), num_kv_heads=64)
    assert kv_bytes_per_token(mha, "bf16") == 80 * 2 * 64 * 128 * 2 == 2_621_440
    assert kv_bytes_per_sequence(mha, 8192, "bf16") == 21_474_836_480 == 20 * GiB
    # The published model uses GQA with 8 KV heads: 8x fewer bytes.
    #   80 x 2 x 8 x 128 x 2 = 327,680 bytes per token; x 8,192 = 2,684,354,560 bytes = 2.5 GiB
    gqa = preset_config("llama-2-70b")
    assert kv_bytes_per_token(gqa, "bf16") == 327_680
    assert kv_bytes_per_sequence(gqa, 8192, "bf16") == 2_684_354_560 == 2.5 * GiB
    # fp8 KV halves it again: 1,342,177,280 bytes
    assert kv_bytes_per_sequence(gqa, 8192, "fp8") == 1_342_177_280


def test_mla_and_sliding_window_kv():
    # DeepSeek-V3 (MLA) caches a 512-wide latent + a 64-wide shared rotary key per layer:
    #   61 x (512 + 64) x 2 bytes = 70,272 bytes per token
    # Expanded per head it would be 61 x 128 heads x (192 key + 128 value) x 2 = 4,997,120: 71x more.
    assert kv_bytes_per_token(preset_config("deepseek-v3"), "bf16") == 70_272
    # Mistral-7B keeps only its 4,096-token window: at 8,192 tokens still 32 x 2 x 8 x 128 x 2 x 4,096 bytes
    mistral = preset_config("mistral-7b")
    assert kv_bytes_per_sequence(mistral, 8192) == kv_bytes_per_sequence(mistral, 4096) == 536_870_912


def test_zero3_13b_on_8_gpus():
    # Mixed-precision Adam: bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m 4 + v 4 = 16 bytes/param.
    # 13e9 params x 16 = 208 GB on one GPU. ZeRO-3 on 8 GPUs shards all three over the 8 data-parallel ranks:
    #   params 13e9 x 2 / 8 = 3.25 GB, grads 13e9 x 2 / 8 = 3.25 GB, optimizer 13e9 x 12 / 8 = 19.5 GB -> 26 GB
    z3 = training_state_bytes(13e9, dp=8, zero=3)
    assert z3 == {"params": 3.25e9, "grads": 3.25e9, "optimizer": 19.5e9, "total": 26e9}
    # For contrast: ZeRO-0 208 GB; ZeRO-1 (2 + 2 + 12/8 = 5.5 B/param) 71.5 GB; ZeRO-2 (2 + 14/8 = 3.75) 48.75 GB
    assert training_state_bytes(13e9, 8, 0)["total"] == 208e9
    assert training_state_bytes(13e9, 8, 1)["total"] == 71.5e9
    assert training_state_bytes(13e9, 8, 2)["total"] == 48.75e9
    # train_plan counts what PyTorch mixed precision (brrr train, FSDP2) holds of the same 16 bytes: fp32 master
    # weights 4, fp32 gradients 4 (FSDP2 reduces in fp32 into the fp32 shards), Adam m and v 8; bf16 weights exist
    # only as working copies. The llama-2-13b preset has 13,015,864,320 params, / 8 ranks:
    plan = train_plan(preset_config("llama-2-13b"), get_gpu("a100-80gb"), gpus=8, zero=3)
    assert plan["memory"]["params"] == plan["memory"]["grads"] == 13_015_864_320 * 4 / 8
    assert plan["memory"]["optimizer"] == 13_015_864_320 * 8 / 8


def test_4096_cubed_fp16_matmul_on_a100():
    # FLOPs = 2 x 4096^3 = 137,438,953,472. Bytes = A + B + C = 3 x 4096^2 x 2 bytes = 100,663,296.
    # Intensity = 2 n^3 / (6 n^2) = n / 3 = 1,365.33 FLOP/byte.
    # A100 80GB: ridge = 312e12 / 2.039e12 = 153.0 FLOP/byte (40GB: 312 / 1.555 = 200.6) -> compute-bound,
    # at best 137.4e9 / 312e12 = 440.5 us.
    op = matmul(4096, 4096, 4096, dtype="fp16")
    assert op.flops == 137_438_953_472 and op.bytes == 100_663_296
    assert op.intensity == pytest.approx(4096 / 3)
    for name, ridge in (("a100-80gb", 153.016), ("a100-40gb", 200.643)):
        gpu = get_gpu(name)
        assert gpu.ridge("fp16") == pytest.approx(ridge, rel=1e-4)
        placed = place(op, gpu)
        assert placed["bound"] == "compute" and placed["fraction_of_peak"] == 1.0
        assert placed["min_time_s"] == pytest.approx(440.5e-6, rel=1e-3)
    # A 1 x 4096 x 4096 GEMV is the opposite: 2 x 4096^2 FLOPs over (4096^2 + 2 x 4096) x 2 bytes ~ 1 FLOP/byte
    gemv = place(matmul(1, 4096, 4096, dtype="fp16"), get_gpu("a100"))
    assert gemv["bound"] == "memory" and gemv["intensity"] == pytest.approx(0.9995, rel=1e-4)


def test_pipeline_bubbles():
    # 1F1B and GPipe idle (p - 1) of the (m + p - 1) microbatch slots each stage runs through:
    #   p = 4, m = 16: 3 / 19 = 15.8% of the step; relative to the ideal compute time, (p - 1) / m = 3/16 = 18.75%
    for schedule in ("1f1b", "gpipe"):
        bubble = pipeline_bubble(4, 16, schedule)
        assert bubble["fraction"] == pytest.approx(3 / 19) and bubble["overhead"] == pytest.approx(3 / 16)
    # Interleaved with v = 2 chunks per GPU: 3 / (2 x 16 + 3) = 3/35; overhead 3/32
    assert pipeline_bubble(4, 16, "interleaved", chunks=2)["fraction"] == pytest.approx(3 / 35)
    # What 1F1B buys is memory: the first stage holds min(m, p) = 4 microbatches, GPipe all 16; interleaved's
    # first rank 2 x 3 + 1 x 4 + 1 = 11 chunks of half its layers = 5.5; the last rank 1, and 5 chunks = 2.5
    assert in_flight_microbatches(4, 16, "1f1b") == 4
    assert in_flight_microbatches(4, 16, "gpipe") == 16
    assert in_flight_microbatches(4, 16, "interleaved", chunks=2) == 5.5
    assert in_flight_microbatches(4, 16, "1f1b", rank=3) == 1
    assert in_flight_microbatches(4, 16, "interleaved", chunks=2, rank=3) == 2.5


def test_llama31_8b_decode_bytes_and_flops():
    cfg = preset_config("llama-3.1-8b")
    # Weights one decode step reads: everything but the embedding table (a lookup reads 1 row per token):
    #   (8,030,261,248 - 525,336,576) x 2 bytes = 15,009,849,344, + the looked-up row 4,096 x 2 = 8,192
    assert decode_weight_bytes(cfg, 1, "bf16") == 15_009_857_536
    # KV: 32 layers x 2 x 8 heads x 128 x 2 bytes = 131,072 bytes per token; a step at context 4,096 reads
    # 4,096 tokens and writes the new one: 131,072 x 4,097 = 537,001,984
    assert decode_bytes_per_step(cfg, 1, 4096) == 15_009_857_536 + 537_001_984
    # int4 g128: linear weights 7,504,658,432 x (0.5 + 4/128) = 3,986,849,792, norms 266,240 x 2, row 8,192
    assert decode_weight_bytes(cfg, 1, "int4") == 3_986_849_792 + 532_480 + 8_192
    # FLOPs per decoded token at context 4,096: 2N = 2 x 7,504,658,432 (head in, embedding out) = 15,009,316,864
    # plus attention 4 x layers x heads x head_dim x S = 4 x 32 x 32 x 128 x 4,096 = 2,147,483,648
    assert flops_per_token(cfg, 4096) == 15_009_316_864 + 2_147_483_648
    # A 4,096-token causal prefill: 2N x 4,096 + 2 x 32 x 32 x 256 x (4,096 x 4,097 / 2) pairs
    assert prefill_flops(cfg, 4096) == 15_009_316_864 * 4096 + 524_288 * 8_390_656


def test_design_doc_reference_points():
    # DESIGN.md measured the H200's copy bandwidth at 4.27 TB/s; batch-1 decode of the Llama-3.1-8B shape with a
    # 5-token prompt is then bounded by 15.0 GB / 4.27 TB/s = 284 tok/s (DESIGN: "284 tok/s"), and int4 g128
    # by 4.0 GB -> 1,071 tok/s.
    h200 = dataclasses.replace(get_gpu("h200"), bandwidth=4.27e12)
    cfg = preset_config("llama-3.1-8b")
    assert decode_step(cfg, h200, 1, 5)["tok_s_per_seq"] == pytest.approx(284.5, abs=0.1)
    assert decode_step(cfg, h200, 1, 5, weight_dtype="int4")["tok_s_per_seq"] == pytest.approx(1070.7, abs=0.5)


def test_compute_bound_batch_by_hand():
    # Decode is compute-bound once b F / P >= (W + b K) / B, i.e. b >= (W / B) / (F / P - K / B).
    # Llama-3.1-8B on the H200 datasheet (P = 989.4e12, B = 4.8e12), bf16, context 128:
    #   W = 15,009,849,344 weight bytes;  K = 131,072 x 129 + 8,192 = 16,916,480 bytes per sequence
    #   F = 15,009,316,864 + 524,288 x 128 = 15,076,425,728 FLOPs per sequence
    #   F/P = 15.2379 us, K/B = 3.5243 us, W/B = 3,127.05 us -> b >= 266.96 -> 267
    cfg, h200 = preset_config("llama-3.1-8b"), get_gpu("h200")
    assert compute_bound_batch(cfg, h200, 128) == 267
    # At 4,096 tokens the KV alone (537 MB per sequence, 4 FLOP/byte) outweighs the FLOPs: never compute-bound.
    #   F/P = 17,156,800,512 / 989.4e12 = 17.3 us  <  K/B = 537,010,176 / 4.8e12 = 111.9 us
    assert compute_bound_batch(cfg, h200, 4096) is None


def test_moe_decode_reads_only_touched_experts():
    # 8 experts, 2 per token, uniform routing: one token touches 2; two tokens 8 x (1 - (6/8)^2) = 3.5 expected
    assert experts_touched(8, 2, 1) == 2
    assert experts_touched(8, 2, 2) == pytest.approx(3.5)
    # Mixtral-8x7B batch 1 reads its active weights (12,879,925,248 - 131,072,000 embedding) x 2 bytes,
    # and at batch 256 (1 - (3/4)^256 ~ 1) every expert: all 46.7B but the embedding, plus 256 looked-up rows
    cfg = preset_config("mixtral-8x7b")
    assert decode_weight_bytes(cfg, 1) == (12_879_925_248 - 131_072_000) * 2 + 4096 * 2
    assert decode_weight_bytes(cfg, 256) == pytest.approx((46_702_792_704 - 131_072_000) * 2 + 256 * 4096 * 2)


def test_serve_capacity_llama31_8b_on_h200():
    # H200 141e9 bytes x util 0.9 = 126.9e9; weights 8,030,261,248 x 2 = 16,060,522,496;
    # activation reserve for an 8,192-token chunk: 8,192 x (3 x 4,096 + 2 x 14,336) x 2 = 671,088,640
    #   + fp32 logits of 1,024 rows: 1,024 x 128,256 x 4 = 525,336,576 -> 1,196,425,216
    # KV memory = 126.9e9 - 16,060,522,496 - 1,196,425,216 = 109,643,052,288
    # 16-token blocks of 131,072 x 16 = 2,097,152 bytes: 52,281 blocks = 836,496 tokens;
    # a 4,096-token sequence needs 256 blocks -> 204 sequences
    plan = serve_plan(preset_config("llama-3.1-8b"), get_gpu("h200"), batches=(1, 64, 256))
    assert plan["kv_memory_per_gpu"] == 109_643_052_288
    assert plan["kv_tokens"] == 836_496 and plan["max_sequences"] == 204
    assert [row["fits"] for row in plan["decode"]] == [True, True, False]
    # batch 64 at context 4,096: 15,009,849,344 + 64 x (8,192 + 537,001,984) bytes = 49,378,500,608 at 4.8 TB/s
    #   = 10.287 ms per step -> 97.2 tok/s per sequence, 6,221 total
    b64 = plan["decode"][1]
    assert b64["bytes_per_gpu"] == 49_378_500_608
    assert b64["tok_s_total"] == pytest.approx(64 * 4.8e12 / 49_378_500_608)
    # fp8 KV doubles the tokens (65,536 bytes per token): 104,563 blocks -> 1,673,008 tokens
    assert serve_plan(preset_config("llama-3.1-8b"), get_gpu("h200"), kv_dtype="fp8")["kv_tokens"] == 1_673_008


def test_tensor_parallel_splits_weights_and_kv_heads():
    cfg, h100 = preset_config("llama-2-70b"), get_gpu("h100")
    one, four = decode_step(cfg, h100, 1, 1024), decode_step(cfg, h100, 1, 1024, tp=4)
    assert four["bytes_per_gpu"] == pytest.approx(one["bytes_per_gpu"] / 4, rel=1e-6)
    # each layer all-reduces the hidden state twice: 160 ring all-reduces of 8,192 x 2 bytes over
    # 450 GB/s (one direction of 900 GB/s NVLink): 2 x 3/4 x 16,384 / 450e9 + 10 us latency each
    assert four["comm_s"] == pytest.approx(160 * (1.5 * 16_384 / 450e9 + 10e-6))
    # 16 GPUs share 8 KV heads: each keeps one head (replicated), not half of one
    from brrr.analysis.serve import kv_bytes_per_token_per_gpu
    assert kv_bytes_per_token_per_gpu(cfg, "bf16", 16) == 80 * 2 * 1 * 128 * 2


def test_ttft_is_compute_bound_prefill():
    # A 1,024-token prefill of Llama-3.1-8B: 2N x 1,024 + 524,288 x (1,024 x 1,025 / 2) = 15,644,686,811,136 FLOPs;
    # at 989.4 TFLOP/s: 15.81 ms; its bytes (weights once + KV) take 3.2 ms -> compute-bound
    t = ttft(preset_config("llama-3.1-8b"), get_gpu("h200"), 1024)
    assert t["flops_per_gpu"] == 15_009_316_864 * 1024 + 524_288 * 524_800
    assert t["bound"] == "compute" and t["ttft_s"] == pytest.approx(15.8123e-3, rel=1e-4)


def test_training_activations_and_communication():
    cfg = preset_config("llama-3.1-8b")
    # Saved per token per layer, bf16 + flash attention (h 4,096, q 4,096, k = v 1,024, I 14,336, 32 heads):
    #   2 norm inputs 2 x (2h + 4) + 2 normed matmul inputs 2 x 2h          = 32,776
    #   q 2 x 4,096 + k, v 2 x 2 x 1,024 + attention output 2 x 4,096 + lse 4 x 32 = 20,608
    #   MLP gate, up, silu(gate), gate*up: 4 x 2 x 14,336                   = 114,688   -> 168,072
    assert activation_bytes_per_token_per_layer(cfg) == 168_072
    # One 4,096-token sequence, 32 layers, no recompute: 168,072 x 4,096 x 32 = 22,029,533,184 bytes
    plan = train_plan(cfg, get_gpu("h100"), gpus=8, zero=3, efficiency=1.0)  # the roofline
    assert plan["memory"]["activations"] == 22_029_533_184
    # The chunked loss (brrr/train/loss.py) holds one 1,024-token chunk's bf16 logits and bf16 gradient, 4 x 128,256
    # x 1,024 = 525,336,576 bytes (the whole [4,096, 128,256] fp32 logits were 2.1 GB), plus the gradients it
    # computed in forward: the hidden states' 2 x 4,096 x 4,096 = 33,554,432 and the head's 2 x 128,256 x 4,096
    assert plan["memory"]["loss"] == 525_336_576 + 33_554_432 + 1_050_673_152
    # With checkpointing only layer inputs stay (2 x 4,096 x 4,096 x 32 = 1,073,741,824) + one layer rebuilt
    ckpt = train_plan(cfg, get_gpu("h100"), gpus=8, zero=3, checkpointing=True, efficiency=1.0)
    assert ckpt["memory"]["activations"] == 1_073_741_824 + 168_072 * 4096
    # FSDP2's peak with checkpointing is the end of backward: every fp32 gradient shard, and the root group's last
    # reduce-scatter (embedding + head, 2 x 525,336,576 parameters: bf16 gradients 2 + their fp32 copy 4 bytes each)
    m, p8 = ckpt["memory"], 8_030_261_248
    assert m["peak"] == "end of backward" and m["reduce_scatter"] == 6 * 2 * 525_336_576
    assert m["total"] == pytest.approx(16 * p8 / 8 + 6 * 2 * 525_336_576)
    # Bytes each GPU sends per step: DDP ring all-reduce of bf16 grads 2 x (7/8) x 2 x P;
    # ZeRO-3 all-gathers weights twice and reduce-scatters grads once: 3 x (7/8) x 2 x P (1.5x DDP)
    p = 8_030_261_248
    ddp = train_plan(cfg, get_gpu("h100"), gpus=8, zero=0, efficiency=1.0)
    assert ddp["communication_bytes"]["data_parallel"] == pytest.approx(3.5 * p)
    assert plan["communication_bytes"]["data_parallel"] == pytest.approx(5.25 * p)
    # Model FLOPs per token = 3 x forward at 4,096: 3 x (15,009,316,864 + 524,288 x 4,097 / 2) = 48,249,962,496
    assert plan["flops"]["per_token"] == 48_249_962_496
    # 8 H100s x 989.4 TFLOP/s on 8 x 4,096 tokens: step >= 8 x 4,096 x 48.25e9 / 7.915e15 = 199.7 ms; ZeRO-3's
    # 5.25 P bytes at 450 GB/s (93.7 ms) hide under compute, so the roofline MFU is 100%; recompute costs 1/4
    assert plan["time"]["step_s"] == pytest.approx(8 * 4096 * 48_249_962_496 / (8 * 989.4e12))
    assert plan["mfu"] == pytest.approx(1.0) and ckpt["mfu"] == pytest.approx(0.75)
    # a 4-stage pipeline with 16 microbatches: the step stretches by 19/16, and by the busiest stage's excess. The
    # head's 2 x 128,256 x 4,096 FLOPs a token are w = 2.24 layers' (a layer: (15,009,316,864 - 1,050,673,152) / 32
    # + its attention), so the last stage takes 6 layers (6 + w = 8.24) and the others 9, 9, 8: the pace is 9 layers
    # against a mean of (32 + w) / 4
    pp = train_plan(cfg, get_gpu("h100"), gpus=8, tp=2, pp=4, microbatches=16, efficiency=1.0)
    w = 1_050_673_152 / ((15_009_316_864 + 524_288 * 4_097 / 2 - 1_050_673_152) / 32)
    assert head_layers(cfg, 4096) == pytest.approx(w) and pp["stage_layers"] == [9, 9, 8, 6]
    assert pp["time"]["pipeline_s"] == pytest.approx(pp["time"]["compute_s"] * 19 / 16 * 9 / ((32 + w) / 4))


def test_roofline_places_named_ops():
    h200 = get_gpu("h200")
    placed = {p["name"]: p for p in (place(op, h200) for op in transformer_ops(preset_config("llama-3.1-8b")))}
    # ridge = 989.4e12 / 4.8e12 = 206.1 FLOP/byte
    assert h200.ridge() == pytest.approx(206.125)
    assert placed["matmul 8192x8192x8192"]["bound"] == "compute"  # 8,192 / 3 = 2,731 FLOP/B
    assert placed["matmul 256x256x256"]["intensity"] == pytest.approx(256 / 3)  # 85 FLOP/B: memory-bound
    assert placed["decode GEMV b=1 (4096->28672)"]["intensity"] == pytest.approx(1.0, rel=1e-3)
    # decode attention, GQA 32/8: per KV token 4 x 32 x 128 FLOPs over 2 x 8 x 128 x 2 bytes ~ 4 FLOP/byte
    assert placed["attention decode b=1 x 4096 (1 layer)"]["intensity"] == pytest.approx(4.0, rel=1e-3)
    # causal prefill at 4,096: 2 x 32 x 128 x 4,096 x 4,097 FLOPs over 2 x 4,096 x (2 x 4,096 + 2 x 1,024) bytes
    assert placed["attention prefill 4096 (causal, 1 layer)"]["intensity"] == pytest.approx(
        2 * 32 * 128 * 4096 * 4097 / (2 * 4096 * (2 * 4096 + 2 * 1024)))
    assert placed["RMSNorm 4096x4096"]["intensity"] == pytest.approx(1.0, rel=1e-3)  # 4 FLOPs / 4 bytes
    assert placed["softmax 4096x4096"]["intensity"] == 1.25  # 5 FLOPs / 4 bytes


def test_int4_group_overhead():
    # int4 g128: 4,096 x 4,096 weights = 8,388,608 bytes + 4,096 rows x 32 groups x 4 bytes = 524,288 -> 6.25%
    assert weight_format("int4").matrix_bytes(4096, 4096) == 8_388_608 + 524_288
    # g32 quadruples the overhead: 4,096 x 128 x 4 = 2,097,152
    assert weight_format("int4-g32").matrix_bytes(4096, 4096) == 8_388_608 + 2_097_152


def test_training_memory_peaks_where_the_trainer_does():
    # brrr train on one GPU (autocast over fp32 weights): the peak is the end of forward, when every activation and
    # the loss's chunk are alive beside the fp32 weights, Adam's m and v and autocast's bf16 copies (2 bytes per
    # parameter), but no gradient yet (zero_grad frees them): llama-3.2-1b, 2 x 4,096 tokens
    cfg, h100 = preset_config("llama-3.2-1b"), get_gpu("h100")
    p = param_counts(cfg)["total"]
    m = train_plan(cfg, h100, gpus=1, micro_batch=2, seq_len=4096)["memory"]
    assert m["peak"] == "end of forward" and m["working_weights"] == 2 * p and m["reduce_scatter"] == 0
    assert m["total"] == pytest.approx(12 * p + 2 * p + m["activations"] + m["loss"])
    # DDP keeps its fp32 gradient buckets (every parameter once) beside the same
    ddp = train_plan(cfg, h100, gpus=2, micro_batch=2, seq_len=4096)["memory"]
    assert ddp["ddp_buckets"] == 4 * p and ddp["total"] == pytest.approx(m["total"] + 4 * p)
    # FSDP2 (ZeRO-3) on 4 ranks gathers only the root group (a tied embedding/head: 262,668,288 parameters) and two
    # layers (the one computing, the one prefetched) in bf16
    layer = (p - 262_668_288) / cfg.num_layers
    z3 = train_plan(cfg, h100, gpus=4, zero=3, micro_batch=2, seq_len=4096)["memory"]
    assert z3["working_weights"] == pytest.approx(2 * (262_668_288 + 2 * layer))
    # TP keeps the eager vocabulary-parallel loss; its peak is the start of its backward: the saved fp32 log-softmax
    # and three fp32 buffers of its backward, 16 bytes x vocab / tp per token
    tp = train_plan(cfg, h100, gpus=2, tp=2, micro_batch=2, seq_len=4096)["memory"]
    assert tp["loss"] == 16 * cfg.vocab_size * 8192 / 2


def test_pipeline_memory_is_the_first_ranks_with_its_gathered_weights():
    # llama-3.1-8b on 4 stages with recomputation: the head is 1.7 layers then (layers cost 4/3), so 9/8/8/7. The
    # first rank holds the embedding (525,336,576) and 9 layers of (8,030,261,248 - 2 x 525,336,576) / 32 =
    # 218,112,128 (the final norm spread over them). Under 1F1B its activation peak
    # recurs after backwards began, and torch's pipelining keeps FSDP2's bf16 weights gathered and the gradients
    # unsharded in fp32 until the last microbatch: 2 + 4 bytes on each of its parameters besides the state
    cfg, h100 = preset_config("llama-3.1-8b"), get_gpu("h100")
    kw = dict(gpus=4, zero=3, pp=4, microbatches=8, micro_batch=1, seq_len=4096, checkpointing=True)
    plan = train_plan(cfg, h100, **kw)
    local, m = 525_336_576 + 9 * 218_112_128, plan["memory"]
    assert plan["stage_layers"] == [9, 8, 8, 7] and m["rank"] == "first stage"
    assert m["working_weights"] == pytest.approx(2 * local) and m["grads"] == pytest.approx(4 * local)
    assert m["end_of_forward"] == pytest.approx(16 * local + 2 * local + m["activations"])
    # GPipe's peak, the end of all forwards, comes before any backward: two layers' weights gathered, no gradients
    gpipe = train_plan(cfg, h100, **{**kw, "schedule": "gpipe"})["memory"]
    assert gpipe["working_weights"] == pytest.approx(2 * (525_336_576 + 2 * 218_112_128))
    assert gpipe["end_of_forward"] == pytest.approx(12 * local + gpipe["working_weights"] + gpipe["activations"])


def test_expert_parallel_plan_by_hand():
    """Mixtral-8x7B, 8 H100s, --ep 8, ZeRO-0: each rank holds 1 of 8 experts per layer (their 16 bytes of state
    divided by 8, unsharded since no other rank holds them) and all of the dense weights; each forward's
    all-to-alls send 2 x 32 layers x 4096 tokens x top-2 x 4096 x 2 bytes x 7/8."""
    from brrr.analysis.train import all_to_all_bytes

    cfg, gpu = preset_config("mixtral-8x7b"), get_gpu("h100")
    counts = param_counts(cfg)
    experts, dense = counts["routed_experts"], counts["total"] - counts["routed_experts"]
    plan = train_plan(cfg, gpu, gpus=8, ep=8, seq_len=4096)
    assert plan["memory"]["optimizer"] == pytest.approx(8 * (dense + experts / 8))
    assert plan["memory"]["params"] == pytest.approx(4 * (dense + experts / 8))
    a2a = 2 * 32 * 4096 * 2 * 4096 * 2 * 7 / 8
    assert all_to_all_bytes(cfg, 4096, 8) == pytest.approx(a2a) == plan["all_to_all_bytes_per_forward"]
    assert plan["communication_bytes"]["expert_parallel"] == pytest.approx(2 * a2a)  # forward and backward
    assert train_plan(cfg, gpu, gpus=8, ep=8, checkpointing=True)["communication_bytes"]["expert_parallel"] == \
        pytest.approx(3 * a2a)  # and the recompute's forward
    assert plan["time"]["expert_parallel_s"] == pytest.approx(2 * a2a / gpu.link_bandwidth)
    # ZeRO-3 over 16 GPUs with --ep 8: each expert is held by 2 ranks, which shard its state
    z3 = train_plan(cfg, gpu, gpus=16, ep=8, zero=3, seq_len=4096)
    assert z3["memory"]["optimizer"] == pytest.approx(8 * (dense / 16 + experts / 8 / 2))
    assert train_plan(cfg, gpu, gpus=8)["communication_bytes"]["expert_parallel"] == 0


@pytest.mark.parametrize("kw, message", [
    (dict(ep=3), "--ep 3 must divide the number of experts"),
    (dict(ep=4, gpus=6), "--ep 4 must divide the data-parallel ranks"),
    (dict(ep=2, tp=2), "does not combine with --tp or --pp"),
    (dict(ep=0), "--ep must be >= 1")])
def test_expert_parallel_plan_refuses_layouts_naming_the_flag(kw, message):
    with pytest.raises(BrrrError, match=message):
        train_plan(preset_config("mixtral-8x7b"), get_gpu("h100"), **{"gpus": 8, **kw})


def test_expert_parallel_needs_an_moe_model():
    with pytest.raises(BrrrError, match="--ep 2 needs an MoE model"):
        train_plan(preset_config("llama-3.1-8b"), get_gpu("h100"), gpus=8, ep=2)
