"""Is the M = 1 W4A16 GEMV bound by HBM or by its own latency? Each 8B projection shape timed with its weights
cold (enough copies to exceed L2, each read once a replay) and hot (one copy, L2-resident after the first call);
then each call preceded by a sleep (idle HBM, as during attention and the norms) with and without a kernel that
asks L2 to prefetch that weight during the sleep. CUDA-graph replays; us per call.

    PYTHONPATH=$PWD python bench/quant_l2_residency.py > bench/results/quant_l2_residency_h200.txt
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from brrr.bench.timing import graph_time_us  # noqa: E402
from brrr.kernels import quant_matmul as qm  # noqa: E402
from brrr.quant import formats  # noqa: E402
from brrr.quant.linear import QuantLinear  # noqa: E402

BF16 = torch.bfloat16
for name, (n, k) in {"q/o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}.items():
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    q = QuantLinear("int4", formats.quantize_int4(w, 128), k, n, None, dtype=BF16)
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    qm.w4a16_matmul_triton(x, q.qweight, q.scales, q.zeros, 128)
    copies = max(1, int(200e6 // (n * k // 2)))
    ws = [QuantLinear("int4", formats.quantize_int4(w, 128), k, n, None, dtype=BF16) for _ in range(copies)]
    cold = graph_time_us([lambda m=m: m(x) for m in ws])
    hot = graph_time_us([lambda: q(x)] * copies)
    print(name, "cold", round(cold, 2), "hot", round(hot, 2), "bytes MB", n * k / 2 / 1e6, flush=True)


@triton.jit
def _pf(P, n_lines, PER: tl.constexpr):
    i = tl.program_id(0) * PER + tl.arange(0, PER)
    qm._prefetch_l2(P + i.to(tl.int64) * 32, i < n_lines)


def prefetch(t):
    lines = t.numel() * t.element_size() // 128
    _pf[(triton.cdiv(lines, 1024),)](t.view(torch.int32), lines, PER=1024, num_warps=4)


print("prefetch then sleep then gemv, vs sleep then gemv (us per iteration)")
for name, (n, k) in {"q/o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}.items():
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    copies = max(2, int(200e6 // (n * k // 2)))
    ws = [QuantLinear("int4", formats.quantize_int4(w, 128), k, n, None, dtype=BF16) for _ in range(copies)]
    ws[0](x)
    for sleep in (2000, 10000, 20000):
        base = graph_time_us([lambda m=m: (torch.cuda._sleep(sleep), m(x)) for m in ws])
        pre = graph_time_us([lambda m=m: (prefetch(m.qweight), torch.cuda._sleep(sleep), m(x)) for m in ws])
        sl = graph_time_us([lambda m=m: torch.cuda._sleep(sleep) for m in ws])
        print(name, "sleep", sleep, "sleep alone", round(sl, 2), "no prefetch", round(base, 2), "prefetch", round(pre, 2), flush=True)
