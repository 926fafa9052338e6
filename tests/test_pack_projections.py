"""The serving fast path's packed q/k/v and gate/up GEMMs compute the same function as the separate ones."""
import pytest
import torch

from brrr import load_model
from brrr.kernels import AttnMeta
from brrr.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from brrr.models.llama import pack_projections
from tests import hf_models


@pytest.mark.parametrize("family", ["qwen2-bias", "qwen3-qknorm", "llama-attn-bias", "mqa"])
def test_packed_model_matches_unpacked(tmp_path, family):
    path = hf_models.save(hf_models.build(family), tmp_path)
    ref, packed = load_model(path, dtype=torch.float32), load_model(path, dtype=torch.float32)
    assert pack_projections(packed) == 2 * packed.config.num_layers
    assert pack_projections(packed) == 0  # idempotent
    assert packed.model.layers[0].self_attn.q_proj is None  # originals dropped, not kept beside the packed copy
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref.compute_logits(ref(ids, torch.arange(11), AttnMeta.causal([11], "cpu")))
        got = packed.compute_logits(packed(ids, torch.arange(11), AttnMeta.causal([11], "cpu")))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    from brrr.loader import hf_state_dict
    split, names = hf_state_dict(packed), hf_state_dict(ref)
    assert split.keys() == names.keys() and all(torch.equal(split[k], names[k]) for k in names)  # saved as HF names


def test_silu_and_mul_reads_strided_halves():
    gate_up = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(1))
    gate_up = gate_up.cuda() if torch.cuda.is_available() else gate_up  # Triton runs on CUDA, or interpreted
    gate, up = gate_up.chunk(2, -1)  # row stride 600: the packed GEMM's output, read in place
    torch.testing.assert_close(silu_and_mul_triton(gate, up), silu_and_mul_ref(gate, up), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_heads_cut_from_the_packed_output():
    from brrr.kernels.rms_norm import rms_norm_ref, rms_norm_triton
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(2))
    qkv = qkv.cuda() if torch.cuda.is_available() else qkv
    q = qkv.split([64, 32, 32], -1)[0].view(7, 4, 16)  # row stride 128, heads 16 apart: not viewable as 2-D
    w = torch.rand(16, generator=torch.Generator().manual_seed(3)).to(qkv.device)
    torch.testing.assert_close(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), rtol=1e-6, atol=1e-6)
