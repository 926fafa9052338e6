"""What one kernel-to-kernel dependency costs on the GPU: a captured chain of tiny kernels, each reading the previous
one's output, timed per link (the difference of two chain lengths, so the graph's own start and end drop out).

Modes: `plain` (stream order), `pdl` (griddepcontrol.wait, then release the next launch: the decode kernels'
PDL 2), `flag` (release the next launch, then spin on the previous kernel's arrival counter with an acquire load;
each program counts itself in the kernel's counter with a release add after its stores, and waits on the grid
dependency only before it exits, so no kernel completes before the one it follows), `flag-late` (the same, but
polling with a 64 ns back-off and releasing the next launch only once the counter is full, as `pdl` does).

    PYTHONPATH=$PWD python bench/sync_latency.py --out bench/results/sync_latency_h200.jsonl
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from brrr.bench.latency import emit  # noqa: E402
from brrr.bench.timing import replay_time_us  # noqa: E402

MODES = {"plain": 0, "pdl": 1, "flag": 2, "flag-late": 3}


@triton.jit
def _acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _backoff():
    tl.inline_asm_elementwise("nanosleep.u32 64; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _link(PREV, OUT, CPREV, CCUR, prev_programs, WORK, work_words, MODE: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, WORDS)
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    if MODE >= 2:
        if MODE == 2:
            gdc_launch_dependents()
        seen = _acquire(CPREV)
        while seen < prev_programs:
            if MODE == 3:
                _backoff()
            seen = _acquire(CPREV)
        if MODE == 3:
            gdc_launch_dependents()
    v = tl.load(PREV + (pid % prev_programs) * WORDS + offs, cache_modifier=".cg")
    acc = v
    for i in range(0, work_words, WORDS):  # a stream of constants, like a GEMV's weights
        acc += tl.load(WORK + pid * work_words + i + offs)
    tl.store(OUT + pid * WORDS + offs, acc + 1)
    if MODE >= 2:
        tl.debug_barrier()  # every thread's store before the count
        tl.atomic_add(CCUR, 1, sem="release")
        gdc_wait()


def chain_us(links: int, programs: int, warps: int, mode: str, work_words: int) -> float:
    words = 32 * warps
    bufs = [torch.zeros(programs * words, dtype=torch.int32, device="cuda") for _ in range(2)]
    work = torch.ones(max(1, programs * work_words), dtype=torch.int32, device="cuda")
    counters = torch.zeros(links + 1, dtype=torch.int32, device="cuda")
    m = MODES[mode]

    def run():
        counters.zero_()
        counters[:1].fill_(programs)
        for i in range(links):
            _link[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], counters[i:], counters[i + 1:], programs, work,
                               work_words, MODE=m, WORDS=words, num_warps=warps, launch_pdl=m > 0)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return replay_time_us(graph, 50)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--programs", nargs="+", type=int, default=[8, 132, 264, 528, 1056])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--work-kb", nargs="+", type=int, default=[0, 32])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args(argv)
    machine = torch.cuda.get_device_name()
    short, long = 20, 60
    for kb in args.work_kb:
        for programs in args.programs:
            for warps in args.warps:
                for mode in args.modes:
                    ww = kb * 1024 // 4
                    per = (chain_us(long, programs, warps, mode, ww) - chain_us(short, programs, warps, mode, ww)) / (
                        long - short)
                    emit(dict(bench="sync_latency", machine=machine, mode=mode, programs=programs, warps=warps,
                              work_kb=kb, us_per_link=round(per, 3)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
