"""2:4 sparsity on CUDA: SemiSparseLinear (torch's semi-structured sparse GEMM) against the dense GEMM of the same
zeros, and a 2:4-pruned default model through the engine (prepare_for_serving swaps its projections, packed ones
included; its logits match the dense model's, CUDA-graph decode runs)."""
import pytest
import torch
import torch.nn.functional as F

import brrr
from brrr.cli import main
from brrr.kernels import AttnMeta
from brrr.prune.magnitude import magnitude_prune
from brrr.prune.mask import parse_pattern
from brrr.prune.semi_structured import SemiSparseLinear, supports_semi_structured, swap_semi_structured
from brrr.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
TWO_FOUR = parse_pattern(None, "2:4")


@pytest.mark.parametrize("n,k", [(256, 256), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 7, 64, 300, 2048])
def test_semi_sparse_linear_matches_the_dense_gemm(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = magnitude_prune(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16), TWO_FOUR)
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert supports_semi_structured(w.device, w.dtype, n, k)
    sparse = SemiSparseLinear(w, bias)
    ref = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(sparse(x).float(), ref, rtol=2e-2, atol=2e-2 * k ** 0.5)
    torch.testing.assert_close(sparse.dense_weight(), w)


def test_a_dense_model_is_left_alone():
    model = brrr.load(device="cuda", dtype="bfloat16").model
    assert swap_semi_structured(model) == []


@pytest.fixture(scope="module")
def pruned_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned-2-4")
    assert main(["prune", "--method", "magnitude", "--pattern", "2:4", "--out", str(out)]) == 0
    return out


def test_a_shape_is_swapped_only_where_the_sparse_gemm_is_faster(pruned_dir):
    from brrr.prune import semi_structured

    model = brrr.load(pruned_dir, device="cuda", dtype="bfloat16").model
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules()
              if type(m) is torch.nn.Linear and ".layers." in f".{n}"}
    swapped = swap_semi_structured(model)
    want = [n for n, shape in shapes.items()
            if semi_structured.sparse_is_faster(torch.device("cuda"), torch.bfloat16, *shape)]
    assert sorted(swapped) == sorted(want)
    assert all(isinstance(v, bool) for v in semi_structured._faster.values()) and semi_structured._faster


def test_the_engine_runs_a_2_4_model_on_the_sparse_gemm(pruned_dir, monkeypatch):
    # the sparse path itself, on every shape, whichever GEMM this GPU times faster
    monkeypatch.setattr("brrr.prune.semi_structured.sparse_is_faster", lambda *a: True)
    dense = brrr.load(pruned_dir, device="cuda", dtype="bfloat16").model
    llm = brrr.LLM(str(pruned_dir), device="cuda", dtype="bfloat16")
    model = llm.engine.model
    swapped = [n for n, m in model.named_modules() if isinstance(m, SemiSparseLinear)]
    assert len(swapped) >= 3 * dense.config.num_layers, swapped  # packed qkv, gate_up, o and down at least
    ids = torch.tensor([5, 17, 99, 3, 250, 1000, 7, 8], device="cuda")
    meta = AttnMeta.causal([len(ids)], "cuda")
    with torch.no_grad():
        want = dense.compute_logits(dense(ids, torch.arange(len(ids), device="cuda"), meta)).float()
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 32
    # the engine's own forward on the same ids, outside its cache: the reference model with the sparse modules
    reference = brrr.load(pruned_dir, device="cuda", dtype="bfloat16").model
    assert swap_semi_structured(reference)
    with torch.no_grad():
        got = reference.compute_logits(reference(ids, torch.arange(len(ids), device="cuda"), meta)).float()
    # bf16: the sparse GEMMs (packed qkv and gate_up) sum in another order than the dense reference's separate
    # ones; on the H200 one logit in 65,536 differed by 0.063
    torch.testing.assert_close(got, want, rtol=5e-2, atol=1e-1)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_pruning_on_the_gpu_hits_the_pattern(method):
    from brrr.prune.layerwise import prune_model
    from brrr.prune.mask import is_n_m
    from brrr.quant.linear import projections

    model = brrr.load(device="cuda", dtype="float32").model
    calib = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    config = prune_model(model, method, TWO_FOUR, calib)
    assert config["global_sparsity"] == 0.5
    assert all(is_n_m(m.weight, 2, 4) and m.weight.is_cuda for _, m in projections(model))


def test_the_output_is_row_major():
    """The packed qkv output is split and viewed per head by the attention kernels: rows must be contiguous."""
    w = magnitude_prune(torch.randn(768, 256, device="cuda", dtype=torch.bfloat16), TWO_FOUR)
    for m in (1, 5, 64):
        assert SemiSparseLinear(w, None)(torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)).is_contiguous()
