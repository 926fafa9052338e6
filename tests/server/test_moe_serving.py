"""`brrr serve`'s app over a mixture-of-experts, latent-attention model: greedy completions equal transformers'
greedy tokens (the engine in a process of its own, as `brrr serve` runs it)."""
import httpx

from brrr.tokenizer import Tokenizer
from tests import hf_models
from tests.engine.test_engine import hf_greedy
from tests.server.conftest import serve, start_engine


def test_greedy_completions_equal_transformers(tmp_path):
    # DeepSeek-V3: experts (grouped sigmoid router, shared expert, a dense first layer) and MLA's latent cache
    hf = hf_models.build("deepseek-v3", vocab_size=320)
    hf_models.save_tokenizer(tmp_path)
    hf_models.save(hf, tmp_path)
    prompts = [[5 + (7 * i + j) % 280 for j in range(9 + 5 * i)] for i in range(3)]
    tokenizer = Tokenizer.from_dir(tmp_path)
    with serve(start_engine(tmp_path, None), tmp_path) as server:
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompts, "max_tokens": 10, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [tokenizer.decode(hf_greedy(hf, p, 10)) for p in prompts]
