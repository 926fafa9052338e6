"""`brrr merge`: the merged directory gives the unmerged adapter's greedy tokens (transformers + PEFT as the oracle),
in transformers and in brrr; an adapter for another base is refused before anything is written."""
import pytest
import torch
import transformers

from brrr.cli import main
from brrr.errors import BrrrError
from brrr.lora.merge import merge_adapter
from tests.hf_models import build, save, save_tokenizer

peft = pytest.importorskip("peft")
PROMPT = [[7, 31, 200, 5, 64]]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tokenizer(save(build("qwen2-bias", vocab_size=320), tmp_path_factory.mktemp("base"), sharded=True))


def _greedy(model):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=10, do_sample=False)[0].tolist()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merged_model_gives_the_adapters_greedy_tokens(tmp_path, base_dir, dora):
    torch.manual_seed(3)
    config = peft.LoraConfig(r=8, lora_alpha=32, init_lora_weights=False, use_dora=dora,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    unmerged = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_dir), config).eval()
    unmerged.save_pretrained(tmp_path / "adapter")
    want = _greedy(unmerged)
    assert want != _greedy(transformers.AutoModelForCausalLM.from_pretrained(base_dir))  # the adapter matters
    assert main(["merge", "--model", str(base_dir), "--adapter", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()  # the base's shards, kept
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert _greedy(merged) == want
    import brrr
    from brrr.sampling_params import SamplingParams

    ours = brrr.load(tmp_path / "merged", dtype="float32", device="cpu")
    tokens = list(ours.generate_ids(PROMPT[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
    assert PROMPT[0] + tokens == want


def test_adapter_for_another_base_is_refused(tmp_path, base_dir):
    other = build("qwen2-bias", vocab_size=320, intermediate_size=96)
    peft.get_peft_model(other, peft.LoraConfig(r=4, target_modules=["down_proj"])).save_pretrained(tmp_path / "a")
    with pytest.raises(BrrrError, match="another base model"):
        merge_adapter(base_dir, tmp_path / "a", tmp_path / "out")
    assert not (tmp_path / "out").exists()
