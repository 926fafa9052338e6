"""`brrr serve --lora-modules ... --max-loras --max-lora-rank` as a real process: the flags reach the engine, the
adapter is listed and served by name; a malformed --lora-modules fails before anything loads."""
import signal

import httpx

from brrr.cli import main
from brrr.lora import save_adapter
from brrr.pretrained import load
from tests import hf_models
from tests.lora.test_serving_engine import random_adapter
from tests.server.test_cli import start_server


def test_serve_with_lora_modules(tmp_path):
    hf_models.save_tokenizer(tmp_path / "base")
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320), tmp_path / "base")
    model = load(tmp_path / "base", dtype="float32", device="cpu").model
    save_adapter(tmp_path / "sql", random_adapter(model, 1, r=8))
    save_adapter(tmp_path / "big", random_adapter(model, 2, r=16))
    proc, url = start_server(tmp_path / "base", "--served-model-name", "base", "--lora-modules",
                             f"sql={tmp_path / 'sql'}", "--max-loras", "2", "--max-lora-rank", "8",
                             "--enable-runtime-lora", "--lora-dirs", str(tmp_path))
    try:
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("sql", "base")]
        r = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": [1, 2, 3], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        big = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path / "big")})
        assert big.status_code == 400 and "--max-lora-rank=8" in big.json()["error"]["message"]
        # outside --lora-dirs: one answer, whether the path exists (this test's own file) or not
        outside = [httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}).json()
                   for path in (__file__, "/nonexistent/adapter", str(tmp_path / ".." / "elsewhere"))]
        assert outside[0] == outside[1] == outside[2] and outside[0]["error"]["param"] == "lora_path", outside
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_malformed_lora_modules_fail_first(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path), "--lora-modules", "no-equals-sign"]) == 2
    assert "--lora-modules 'no-equals-sign': expected name=path" in capsys.readouterr().err
