"""The one-shot all-reduce on CUDA (symmetric memory over NVLink P2P, no multicast): its sums equal NCCL's, eagerly
and replayed from a CUDA graph, at the decode messages' sizes in bf16 and fp32; an engine with it forced on for
every decode message gives one GPU's greedy tokens, eagerly and through its decode graphs; the start-up choice
runs on a real group. Needs two GPUs (four for the TP 4 case)."""
import pytest
import torch
import torch.multiprocessing as mp

from tests import hf_models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

HIDDEN = 4096  # the llama-3.1-8b message: [rows, 4096]
ROWS = (1, 3, 8, 64, 256)
CAPACITY = 256 * HIDDEN * 4  # the largest message in fp32
# the sums of N unit normals added in another order (NCCL's ring vs one kernel's rank order), each partial sum
# rounded: a few ulps of the partial sums' magnitude in bf16; a wrong or missing rank's term is off by ~1
TOLERANCE = {torch.bfloat16: dict(atol=6e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _partial(rank: int, rows: int, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 * seed + 10 * rank + rows)
    return torch.randn(rows, HIDDEN, generator=g).to(dtype=dtype, device=device)


def _rank_main(rank: int, world: int, store_path: str) -> None:
    """One rank of the comparison; an assertion here fails the spawning test with this traceback."""
    from brrr.distributed.tp_worker import connect

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm = connect(store_path, rank, world, device)
    try:
        why = comm.setup_oneshot(device, CAPACITY)
        assert why is None, f"rank {rank}: one-shot setup failed: {why}"
        comm.set_oneshot_bound(CAPACITY)
        for dtype in (torch.bfloat16, torch.float32):
            for rows in ROWS:
                x = _partial(rank, rows, dtype, device)
                want = comm.nccl_all_reduce(x.clone())
                assert comm.routes_to_oneshot(x)
                got = comm.all_reduce(x.clone())
                torch.testing.assert_close(got, want, **TOLERANCE[dtype],
                                           msg=lambda m: f"eager {dtype} rows {rows}: {m}")
        # an input whose storage starts 2 bytes into its buffer: copied into the symmetric buffer first
        base = _partial(rank, 9, torch.bfloat16, device).view(-1)
        shifted = base[1: 1 + 8 * HIDDEN].view(8, HIDDEN)
        want = comm.nccl_all_reduce(shifted.clone())
        torch.testing.assert_close(comm.all_reduce(shifted), want, **TOLERANCE[torch.bfloat16])
        # captured once, replayed with new inputs: the symmetric buffer and signal pads serve every replay
        for dtype in (torch.bfloat16, torch.float32):
            static_in = torch.zeros(8, HIDDEN, dtype=dtype, device=device)
            for _ in range(3):
                comm.all_reduce(static_in.clone())
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = comm.all_reduce(static_in * 1)
                static_out = comm.all_reduce(static_out * 0.5)  # two in a row, as in a layer
            for seed in range(3):
                x = _partial(rank, 8, dtype, device, seed + 1)
                static_in.copy_(x)
                graph.replay()
                want = comm.nccl_all_reduce(comm.nccl_all_reduce(x.clone()) * 0.5)
                torch.testing.assert_close(static_out, want, **TOLERANCE[dtype],
                                           msg=lambda m: f"graph {dtype} replay {seed}: {m}")
        torch.cuda.synchronize()
    finally:
        comm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_oneshot_sums_equal_nccl_eagerly_and_in_graphs(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    mp.spawn(_rank_main, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


# Each engine test runs in a process of its own: PyTorch counts symmetric-memory rendezvous per process
# (pytorch/pytorch#196082), so brrr sets the one-shot path up for a process's first TP engine only.
FORCED_SCRIPT = """
import gc, sys
import torch
import brrr.distributed.tp_group as tp_group
from brrr import LLM, SamplingParams

path, cuda_graphs = sys.argv[1], sys.argv[2] == "graphs"
torch.backends.cuda.matmul.allow_tf32 = False
prompts = [[1 + i, 5, 9, 30 + i] * (1 + i % 4) for i in range(20)]
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
args = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.05, max_num_batched_tokens=64,
            pack_projections=False, cuda_graphs=cuda_graphs)
generate = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
one = LLM(path, **args)
want = generate(one)
del one
gc.collect()
torch.cuda.empty_cache()
# rank 0 decides for every rank: one-shot for every timed size, whatever the timings said
tp_group.choose_bound = lambda timings: max(b for b, _, _ in timings)
llm = LLM(path, tensor_parallel_size=2, **args)
try:
    comm = llm.engine.model.tp_comm
    assert comm.oneshot is not None and comm.oneshot_bound > 0
    assert bool(llm.engine.runner.graphs) == cuda_graphs
    times = llm.engine.runner.time_all_reduce(1)
    assert times["all_reduce_backend"] == "oneshot" and times["all_reduce_us_oneshot"] > 0
    got = generate(llm)
finally:
    llm.engine.runner.shutdown()
assert got == want, (got, want)
print("OK", flush=True)
"""

CHOICE_SCRIPT = """
import logging, sys
import torch
from brrr import LLM

lines = []
handler = logging.Handler()
handler.emit = lambda r: lines.append(r.getMessage())
logging.getLogger("brrr.engine").addHandler(handler)
logging.getLogger("brrr.engine").setLevel(logging.INFO)
torch.backends.cuda.matmul.allow_tf32 = False
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.05,
          max_num_batched_tokens=64)
try:
    lines = [m for m in lines if "tensor-parallel all-reduce" in m]
    assert len(lines) == 1 and "one-shot up to" in lines[0], lines  # set up on both ranks, both timed
    times = llm.engine.runner.time_all_reduce(1)
    assert times["all_reduce_us_nccl"] > 0 and times["all_reduce_us_oneshot"] > 0
finally:
    llm.engine.runner.shutdown()
print("OK", flush=True)
"""


def _fresh_process(tmp_path, script, *args):
    import subprocess
    import sys

    hf_models.save_tokenizer(tmp_path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=321), tmp_path, sharded=True)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), *args], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("cuda_graphs", ["eager", "graphs"])
def test_tp2_with_oneshot_forced_matches_one_gpu(tmp_path, cuda_graphs):
    _fresh_process(tmp_path, FORCED_SCRIPT, cuda_graphs)


def test_tp2_start_up_choice_is_measured_and_logged(tmp_path):
    _fresh_process(tmp_path, CHOICE_SCRIPT)


STUCK_SCRIPT = """
import os, signal, sys, threading, time
import brrr.distributed.oneshot as oneshot
import brrr.distributed.tp_group as tp_group
from brrr import LLM, SamplingParams

tp_group.choose_bound = lambda timings: max(b for b, _, _ in timings)  # one-shot for every decode message
tp_group.LaunchWatchdog = lambda procs, _timeout: oneshot.LaunchWatchdog(procs, 3.0)  # NCCL's stays 120 s
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cuda", gpu_memory_utilization=0.05,
          max_num_batched_tokens=64)
worker = llm.engine.runner.workers.procs[0].pid
os.kill(worker, signal.SIGSTOP)  # alive, so the next step is sent; it never joins the one-shot kernel
threading.Timer(2.0, os.kill, (worker, signal.SIGKILL)).start()  # then dies, the kernel still waiting on it
print("generating", flush=True)
llm.generate([[1, 5, 9, 30]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
print("not stuck", flush=True)
"""


def test_a_worker_dying_inside_the_oneshot_kernel_ends_rank_0_instead_of_hanging(tmp_path):
    import subprocess
    import sys

    hf_models.save_tokenizer(tmp_path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=321), tmp_path, sharded=True)
    done = subprocess.run([sys.executable, "-c", STUCK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    assert "generating" in done.stdout and "not stuck" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.returncode == 1 and "waited on it in the one-shot all-reduce" in done.stderr, done.stderr[-2000:]
