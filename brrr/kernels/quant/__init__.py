"""Quantized matmuls: int4 group-wise (W4A16) and int8 / E4M3 per-channel (W8A16) weights dequantized in
registers, the per-token activation quantization W8A8 runs before torch's GEMM, and GPTQ's block sweep. The
package exports the matmuls' API; gptq_block.py and int8_rescale.py are imported by their module paths.

  layouts.py     the weights' kernel layouts (int4 nibble packing, chunk-major), the torch references
  ptx.py         the inline-PTX conversions as text, per 16-bit type
  dequant.py     codes -> values in Triton (PTX on the GPU, casts under the interpreter); whole-weight dequantize
  epilogue.py    tile and K-slice indexing, the tensor-core dot, the split-K epilogue
  gemm.py        tensor-core tiles for every M, and the int4 MMA decode kernel
  gemv.py        CUDA-core GEMVs (M <= 4)
  mma_gemv.py    MMA GEMVs (M = 1), with gate/up SiLU-and-mul, RMSNorm and residual epilogues
  configs.py     every family's candidate configs and the M limits between paths
  tune.py        per-(device, shape, bucket) tuning at warm-up (`quant_tuning`), lookups after
  launch.py      a config -> a kernel launch (split K, workspace, PDL)
  matmul.py      the entry points and dispatchers
  groupwise.py   GGUF's Q8_0 / Q4_K / Q5_K / Q6_K group-wise layouts: their matmul (GEMV and tiles), the reference
  groupwise_configs.py  the group-wise kernel's fixed plan, tuning candidates and config validity
  per_token.py   per-token int8 / E4M3 activation quantization
  gptq_block.py  GPTQ's column sweep over one block
  int8_rescale.py  SmoothQuant's int32 -> output epilogue
"""
from brrr.kernels.quant.configs import CANDIDATES, DEQUANT, LIMITS, w4_configs, w8_configs
from brrr.kernels.quant.dequant import dequantize_w4_triton, dequantize_w8_triton
from brrr.kernels.quant.groupwise import GROUPWISE_GROUPS, dequantize_groupwise, groupwise_matmul
from brrr.kernels.quant.layouts import (CHUNK, INT4_GROUPS, chunk_major, dequantize_w4, int4_params, int4_round,
                                        pack_int4_kernel, unpack_int4_kernel, w4a16_matmul_ref, w8a16_matmul_ref)
from brrr.kernels.quant.matmul import (w4a16_gated_matmul, w4a16_matmul, w4a16_matmul_triton, w8a16_gated_matmul,
                                       w8a16_matmul, w8a16_matmul_triton, with_norm_and_residual)
from brrr.kernels.quant.per_token import quantize_per_token, quantize_per_token_ref, quantize_per_token_triton
from brrr.kernels.quant.tune import TUNED_CONFIGS, TuningReport, bucket_sizes, quant_tuning

__all__ = ["CANDIDATES", "CHUNK", "DEQUANT", "GROUPWISE_GROUPS", "INT4_GROUPS", "LIMITS", "TUNED_CONFIGS",
           "TuningReport", "bucket_sizes", "chunk_major", "dequantize_groupwise", "dequantize_w4",
           "dequantize_w4_triton", "dequantize_w8_triton", "groupwise_matmul", "int4_params", "int4_round",
           "pack_int4_kernel", "quant_tuning", "quantize_per_token", "quantize_per_token_ref",
           "quantize_per_token_triton", "unpack_int4_kernel", "w4_configs", "w4a16_gated_matmul", "w4a16_matmul",
           "w4a16_matmul_ref", "w4a16_matmul_triton", "w8_configs", "w8a16_gated_matmul", "w8a16_matmul",
           "w8a16_matmul_ref", "w8a16_matmul_triton", "with_norm_and_residual"]
