"""Accelerator specs from their datasheets, and `measure()` for the GPU in this machine.

Units are SI: bytes, bytes/s, FLOP/s (GB = 1e9 bytes). Compute figures are DENSE peaks: datasheets print
"with sparsity" numbers for tensor cores, and those are halved here. int8 figures are OP/s.
`interconnect` is the GPU-to-GPU link (NVLink, Infinity Fabric) as datasheets quote it: both directions
summed, per GPU; `pcie` likewise. Collective-time estimates use half of it (one direction).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from brrr.errors import BrrrError

GB, TFLOPS = 1e9, 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float  # bytes of device memory
    bandwidth: float  # bytes/s of device memory
    flops: dict = field(default_factory=dict)  # dtype -> dense peak FLOP/s
    interconnect: float = 0.0  # bytes/s, GPU-to-GPU, both directions summed (0: none)
    pcie: float = 0.0  # bytes/s, both directions summed
    source: str = ""
    datasheet: "GPU | None" = None  # for a measured GPU, its datasheet entry (MFU is quoted against that peak)

    def peak(self, dtype: str = "bf16") -> float:
        if dtype not in self.flops:
            have = ", ".join(self.flops)
            raise BrrrError(f"{self.name} has no {dtype} peak (its tensor cores do: {have})")
        return self.flops[dtype]

    def ridge(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.peak(dtype) / self.bandwidth

    def datasheet_peak(self, dtype: str = "bf16") -> float:
        return (self.datasheet or self).peak(dtype)

    @property
    def link_bandwidth(self) -> float:
        """One direction of the fastest GPU-to-GPU path: what a ring collective moves per GPU per second."""
        return (self.interconnect or self.pcie) / 2


def _gpu(name, memory_gb, bandwidth_gbs, interconnect_gbs, pcie_gbs, source, **tflops):
    return GPU(name, memory_gb * GB, bandwidth_gbs * GB, {k: v * TFLOPS for k, v in tflops.items()},
               interconnect_gbs * GB, pcie_gbs * GB, source)


GPUS = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021), "A100 40GB SXM" column.
    "a100-40gb": _gpu("A100 SXM 40GB", 40, 1555, 600, 64, "NVIDIA A100 datasheet, 40GB SXM",
                      fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
    # Same datasheet, "A100 80GB SXM" column (HBM2e).
    "a100-80gb": _gpu("A100 SXM 80GB", 80, 2039, 600, 64, "NVIDIA A100 datasheet, 80GB SXM",
                      fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column (sparse 1,979 bf16 / 3,958 fp8 halved).
    "h100-sxm": _gpu("H100 SXM", 80, 3350, 900, 128, "NVIDIA H100 datasheet, SXM",
                     fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    # Same datasheet, "H100 PCIe" column (HBM2e; NVLink bridge 600 GB/s).
    "h100-pcie": _gpu("H100 PCIe", 80, 2000, 600, 128, "NVIDIA H100 datasheet, PCIe",
                      fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513, int8=1513),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: H100's compute, 141 GB HBM3e at 4.8 TB/s.
    "h200": _gpu("H200 SXM", 141, 4800, 900, 128, "NVIDIA H200 datasheet, SXM",
                 fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    # NVIDIA HGX B200 spec table (8-GPU totals: 1,440 GB, 64 TB/s, 36 PF bf16 / 72 PF fp8 sparse), per GPU.
    "b200": _gpu("B200 (HGX)", 180, 8000, 1800, 128, "NVIDIA HGX B200 spec, 8-GPU figures / 8, sparse / 2",
                 fp32=75, tf32=1125, bf16=2250, fp16=2250, fp8=4500, int8=4500),
    # NVIDIA L40S datasheet (GDDR6 with ECC; no NVLink; PCIe Gen4 x16).
    "l40s": _gpu("L40S", 48, 864, 0, 64, "NVIDIA L40S datasheet",
                 fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733, int8=733),
    # NVIDIA Ada Lovelace architecture whitepaper, appendix table for GeForce RTX 4090: tensor rates with FP32
    # accumulate (what PyTorch matmuls use; GeForce runs them at half the FP16-accumulate rate).
    "rtx-4090": _gpu("GeForce RTX 4090", 24, 1008, 0, 64, "NVIDIA Ada whitepaper, RTX 4090, FP32 accumulate",
                     fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3, int8=660.6),
    # AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s; 7 Infinity Fabric links x 128 GB/s).
    "mi300x": _gpu("Instinct MI300X", 192, 5300, 896, 128, "AMD Instinct MI300X datasheet",
                   fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9, int8=2614.9),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200", "4090": "rtx-4090", "rtx4090": "rtx-4090"}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise BrrrError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)} (or --measure on a CUDA machine)")
    return GPUS[key]


def _known_spec(device_name: str) -> GPU | None:
    """The datasheet entry for a CUDA device name such as 'NVIDIA H200' or 'NVIDIA A100-SXM4-80GB'."""
    n = device_name.lower()
    for needle, key in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"),
                        ("a100-sxm4-40gb", "a100-40gb"), ("a100", "a100-80gb"), ("l40s", "l40s"),
                        ("4090", "rtx-4090"), ("mi300x", "mi300x")):
        if needle in n:
            return GPUS[key]
    return None


def _seconds_per_call(fn, iters: int, repeats: int = 5) -> float:
    """Fastest of `repeats` timings (CUDA events) of `iters` back-to-back calls, per call, after a warm-up."""
    import torch

    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def measure(device: str = "cuda", copy_bytes: int = 2 << 30, matmul_n: int = 8192, iters: int = 20) -> GPU:
    """This GPU with measured copy bandwidth (device-to-device copy: read + write bytes / time) and bf16/fp16
    matmul rate (2 n^3 / time for an n x n x n matmul). Other dtypes keep the datasheet figures when the
    device is one of GPUS; memory is the device's total."""
    import torch

    if not torch.cuda.is_available():
        raise BrrrError("--measure needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
    props = torch.cuda.get_device_properties(device)
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / _seconds_per_call(lambda: dst.copy_(src), iters)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
    matmul = 2 * matmul_n**3 / _seconds_per_call(lambda: a @ b, iters)
    known = _known_spec(props.name)
    base = known or GPU(props.name, 0, 0)
    flops = {**base.flops, "bf16": matmul, "fp16": matmul}
    source = f"measured on {props.name}: copy {copy_bytes >> 20} MiB, bf16 matmul {matmul_n}^3" + (
        f"; other dtypes and links from {known.source}" if known else "")
    return replace(base, name=f"{props.name} (measured)", memory=float(props.total_memory), bandwidth=bandwidth,
                   flops=flops, source=source, datasheet=known)
