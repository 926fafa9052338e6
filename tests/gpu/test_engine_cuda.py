"""The engine on CUDA (reference ops, CUDA graphs on): KV pool sized by the profiling pass, greedy tokens equal
transformers' in fp32. The Triton path is held to a logit tolerance in tests/gpu/test_fast_path_parity.py."""
import random

import numpy as np
import pytest
import torch

from brrr import load_model
from brrr.config import EngineConfig
from brrr.engine import LLMEngine
from brrr.kernels.dispatch import use_reference
from tests import hf_models
from tests.gpu.test_fast_path_parity import engine_greedy, hf_greedy_cuda

pytestmark = pytest.mark.gpu


def test_engine_on_cuda_matches_transformers(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    with use_reference():
        _check(tmp_path)


def _check(tmp_path):
    hf_models.save(hf_models.build("qwen3-qknorm", max_position_embeddings=512), tmp_path)
    hf = type(hf_models.build("qwen3-qknorm")).from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    model = load_model(tmp_path, dtype=torch.float32, device="cuda")
    engine = LLMEngine(model, config=EngineConfig(gpu_memory_utilization=0.02, max_num_batched_tokens=128))
    assert engine.block_manager.num_blocks > 1000  # sized from the card's memory, not a default
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 200))] for _ in range(16)]
    done = engine_greedy(engine, prompts, 16)
    for i, p in enumerate(prompts):
        assert done[str(i)] == hf_greedy_cuda(hf, p, 16)


def test_copies_on_side_streams_stay_ordered_with_the_compute_stream():
    """h2d uploads on the upload stream and PendingTokens downloads on the download stream, while the compute
    stream is busy: every upload is what the next kernel reads, every download what the kernel before wrote."""
    from brrr.engine.sampler import PendingTokens, copy_stream, h2d

    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    pending = []
    for i in range(30):
        busy = (busy @ busy).clamp_(-1, 1)  # queued work the copies must not wait behind, nor overtake
        values = h2d(list(range(i, i + 1000)), dev)
        assert copy_stream("up", dev) != torch.cuda.current_stream(dev)
        pending.append((i, PendingTokens(values * 3)))
    for i, p in pending:
        assert p.tokens() == [3 * v for v in range(i, i + 1000)]
    # again with the events the read steps gave back, and the runner's packed staging (pinned, one upload)
    from brrr.engine.staging import stage

    pending = []
    for i in range(30):
        busy = (busy @ busy).clamp_(-1, 1)
        ids, rows = stage(dev, np.arange(i, i + 999, dtype=np.int64), np.full((3, 5), i, dtype=np.int32))
        pending.append((i, PendingTokens(ids * 3 + rows.sum())))
    for i, p in pending:
        assert p.tokens() == [3 * v + 15 * i for v in range(i, i + 999)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # inside a capture: the plain path, no side streams
        assert copy_stream("down", dev) is None
        busy.add_(1)
