"""An adapter PEFT created, served by brrr (`LLM(..., enable_lora=True).generate(..., lora_request=...)`), gives
PEFT's greedy tokens on transformers' model; a list of lora requests mixes it with the base in one call."""
import pytest
import torch

from brrr import LLM, SamplingParams
from brrr.engine import LoRARequest
from tests import hf_models

peft = pytest.importorskip("peft")


def test_peft_adapter_gives_peft_greedy_tokens(tmp_path):
    base = hf_models.build("qwen2-bias")
    hf_models.save_tokenizer(tmp_path / "base")
    hf_models.save(base, tmp_path / "base")
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(3)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(tmp_path / "adapter")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
        with model.disable_adapter():
            ids = torch.tensor([prompts[0]])
            plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                   min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    llm = LLM(str(tmp_path / "base"), dtype="float32", device="cpu", num_blocks=64, enable_lora=True,
              max_lora_rank=8)
    lora = LoRARequest("peft", 1, str(tmp_path / "adapter"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in got] == want
    mixed = llm.generate([prompts[0], prompts[0]], params, use_tqdm=False, lora_request=[None, lora])
    assert [o.outputs[0].token_ids for o in mixed] == [plain[0, len(prompts[0]):].tolist(), want[0]]
    assert want[0] != mixed[0].outputs[0].token_ids
