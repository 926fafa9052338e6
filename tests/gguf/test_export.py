"""`brrr export gguf` writes files that gguf.GGUFReader, transformers and brrr read back."""
import pytest
import torch
from gguf import GGUFReader

import brrr
from brrr.cli import main
from brrr.errors import BrrrError


@pytest.mark.parametrize("file_type, types", [
    ("f16", {"F16", "F32"}), ("q8_0", {"Q8_0", "F32"}), ("q4_0", {"Q4_0", "F32"}),
    ("q6_k", {"Q6_K", "Q8_0", "F32"}), ("q4_k_m", {"Q4_K", "Q8_0", "F32"})])
def test_export_reads_back(hf_dir, tmp_path, capsys, file_type, types):
    path, original = hf_dir("qwen3")
    out = tmp_path / f"m-{file_type}.gguf"
    assert main(["export", "gguf", "--model", str(path), "--out", str(out), "--type", file_type,
                 "--no-progress"]) == 0
    assert str(out) in capsys.readouterr().out
    reader = GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    # rows narrower than a 256 super-block (in 64) take Q8_0; o_proj (in 512) takes the K-quant
    assert {t.tensor_type.name for t in reader.tensors} == types
    mine = brrr.load(out, device="cpu")
    ids = mine.tokenizer.encode("Hello, world!")
    with torch.no_grad():
        want = original(torch.tensor([ids])).logits[0]
        got = mine.model.logits(torch.tensor(ids), torch.arange(len(ids)),
                                brrr.kernels.AttnMeta.causal([len(ids)], "cpu"))
    rel = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert rel < {"f16": 1e-3, "q8_0": 0.03, "q4_0": 0.4, "q6_k": 0.05, "q4_k_m": 0.4}[file_type]


def test_k_quant_super_blocks_where_rows_are_wide(tmp_path):
    """Rows of 256 weights or more take the K-quant itself; the Q4_K_M recipe gives output.weight Q6_K."""
    from tests import hf_models

    model = hf_models.build("tied", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False)
    hf_models.save(model, tmp_path)
    hf_models.save_tokenizer(tmp_path)
    out = tmp_path / "k.gguf"
    assert main(["export", "gguf", "--model", str(tmp_path), "--out", str(out), "--type", "q4_k_m",
                 "--no-progress"]) == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    # llama.cpp's use_more_bits: of 2 layers, the last (>= 7/8 of the way) gets Q6_K attn_v and ffn_down
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    ids = list(range(5, 30))

    def error(path):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
            got = brrr.load(path, device="cpu").model.logits(torch.tensor(ids), torch.arange(len(ids)),
                                                            brrr.kernels.AttnMeta.causal([len(ids)], "cpu"))
        return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()

    # a random model amplifies weight noise into its logits; the bar is the gguf package's own 4-bit Q4_0
    assert main(["export", "gguf", "--model", str(tmp_path), "--out", str(tmp_path / "q4_0.gguf"), "--type", "q4_0",
                 "--no-progress"]) == 0
    assert error(out) < error(tmp_path / "q4_0.gguf")
    import transformers  # the oracle reads brrr's K-quant blocks to the same logits brrr does

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0]
        got = brrr.load(out, device="cpu").model.logits(torch.tensor(ids), torch.arange(len(ids)),
                                                        brrr.kernels.AttnMeta.causal([len(ids)], "cpu"))
    assert (got - want).abs().max().item() < 1e-4


def test_bad_export_requests(hf_dir, tmp_path):
    path, _ = hf_dir("llama")
    with pytest.raises(SystemExit):
        main(["export", "gguf", "--model", str(path), "--out", str(tmp_path / "x.gguf"), "--type", "q3_k"])
    assert main(["export", "gguf", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x.gguf")]) == 2
    with pytest.raises(BrrrError, match="not a directory"):
        from brrr.gguf.export import export_gguf
        export_gguf(tmp_path / "nope", tmp_path / "x.gguf")


def test_a_quantized_checkpoint_is_refused(hf_dir, tmp_path):
    import json
    import shutil

    path, _ = hf_dir("llama")
    shutil.copytree(path, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "brrr", "format": "int8"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    from brrr.gguf.export import export_gguf
    with pytest.raises(BrrrError, match="quantization_config"):
        export_gguf(tmp_path / "q", tmp_path / "x.gguf")
