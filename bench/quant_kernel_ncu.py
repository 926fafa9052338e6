"""One launch of each W4A16 decode kernel family at M = 1 on the 8B gate_up shape (28672 x 4096), bf16, for Nsight
Compute: the 16-row tensor-core kernel, the GEMV (CUDA cores) and the MMA decode kernel (weights as wgmma's register
operand), each in the config the tuner picked on the H200 for this shape.

  ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \\
      --section MemoryWorkloadAnalysis -k regex:w4a16 python bench/quant_kernel_ncu.py

With --occupancy: the GEMV and the MMA kernel (no pair, no prefetch) at their configs' split and at "auto16" (more,
shorter programs: higher occupancy), for the question whether more warps per SM make them faster.
With --mma-gemv: the MMA GEMV (mma.sync on the loaded bytes) in its fastest gate_up config and in variants with more
bytes per thread (two groups an iteration, two rows per tile), which ran slower.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from brrr.kernels import quant_matmul as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

n, k = 28672, 4096
q = QuantLinear("int4", formats.quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128), k, n, None,
                dtype=torch.bfloat16)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
if "--mma-gemv" in sys.argv:
    base = dict(qm._mma_gemv_configs(1, 128)[0], BLOCK_N=128, num_warps=8, SPLIT_K="auto4")
    configs = {"mma-gemv": base, "mma-gemv auto8": dict(base, SPLIT_K="auto8"),
               "mma-gemv 2 groups": dict(base, GROUPS=2), "mma-gemv 2 rows": dict(base, BLOCK_N=256),
               "mma-gemv sum x": dict(base, SUM_X=True)}
elif "--occupancy" in sys.argv:
    gemv = next(c for c in qm._gemv_configs(1) if c["BLOCK_N"] == 128 and c["CHUNKS"] == 4 and c["num_warps"] == 2
                and c["PREFETCH"] == 0)
    mma = next(c for c in qm.w4_configs(1, 128) if c.get("MMA") and not c["PAIR"] and not c["PREFETCH"])
    configs = {"gemv": gemv, "gemv auto16": dict(gemv, SPLIT_K="auto16"), "mma": mma,
               "mma auto16": dict(mma, SPLIT_K="auto16")}
else:
    configs = {"tensor-core": qm.w4_configs(1, 128)[0],
               "gemv": next(c for c in qm._gemv_configs(1) if c["BLOCK_N"] == 128 and c["SPLIT_K"] == "auto8"),
               "mma": next(c for c in qm.w4_configs(1, 128) if c.get("MMA") and c["SPLIT_K"] == "auto8")}
for name, cfg in configs.items():
    qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128, config=cfg)  # compile
    torch.cuda.synchronize()
    print(name, cfg, flush=True)
    qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128, config=cfg)
    torch.cuda.synchronize()
