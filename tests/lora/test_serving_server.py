"""`brrr serve` with LoRA adapters, the engine in a process of its own: "model" picks the adapter (the request and
its adapter cross the process boundary), /v1/models lists adapters with their parent, vLLM's load/unload endpoints
work at run time, also while a request of the adapter being unloaded is in flight (it finishes on the adapter), more
adapters than slots still complete, and bad adapters and unknown names get OpenAI's error shape."""
import json
import threading

import httpx
import pytest

from brrr import BrrrError
from brrr.config import EngineConfig
from brrr.lora import save_adapter
from brrr.pretrained import load
from brrr.server.lora_adapters import parse_lora_modules
from tests import hf_models
from tests.lora.test_serving_engine import greedy, merged, prompts_for, random_adapter
from tests.server.conftest import MODEL_NAME, serve, start_engine

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    model_dir = root / "base"
    hf_models.save_tokenizer(model_dir)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=512), model_dir)
    model = load(model_dir, dtype="float32", device="cpu").model
    adapters = {}
    for i in range(4):
        adapter = random_adapter(model, 30 + i, r=4 + 4 * (i % 2))
        adapters[f"a{i}"] = (str(save_adapter(root / f"a{i}", adapter)), adapter)
    other = hf_models.build("llama3-rope", vocab_size=320, hidden_size=96)
    bad = {"other_base": str(save_adapter(root / "other", random_adapter(other, 1))),
           "rank32": str(save_adapter(root / "rank32", random_adapter(model, 2, r=32)))}
    prompts = prompts_for(2, seed=3)
    want = {None: greedy(model, prompts, MAX_TOKENS)}
    for name, (_, adapter) in adapters.items():
        want[name] = greedy(merged(model, adapter), prompts, MAX_TOKENS)
    config = EngineConfig(num_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm = start_engine(model_dir, None, config)
    modules = parse_lora_modules([f"a0={adapters['a0'][0]}", json.dumps({"name": "a1", "path": adapters["a1"][0]})])
    with serve(llm, model_dir, lora_modules=modules, runtime_lora=True) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            yield server, http, adapters, bad, prompts, want


def complete(http, model, prompt, **kw):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                              "temperature": 0, "ignore_eos": True, **kw})


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["x=/a", '{"name": "y", "path": "/b", "base_model_name": "m"}']) == [("x", "/a"),
                                                                                                   ("y", "/b")]
    for bad in ["x", "=/a", '{"name": "y"}', "{not json"]:
        with pytest.raises(BrrrError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_models_and_adapters_by_name(setup):
    server, http, adapters, _, prompts, want = setup
    cards = http.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL_NAME, None), ("a0", MODEL_NAME), ("a1", MODEL_NAME)]
    assert cards[1]["root"] == adapters["a0"][0]
    for name in ("a2", "a3"):  # at run time: 4 adapters over 2 slots, all in flight at once
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name][0]})
        assert r.status_code == 200 and "added" in r.text
    jobs = [(model, i) for model in (MODEL_NAME, "a0", "a1", "a2", "a3") for i in range(len(prompts))]
    results = {}

    def run(model, i):
        results[model, i] = complete(http, model, prompts[i])

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (model, i), r in results.items():
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        oracle = want[None if model == MODEL_NAME else model][i]
        assert r.json()["choices"][0]["text"] == server.llm.tokenizer.decode(oracle)
    server.assert_all_blocks_free()


def test_unknown_model_and_bad_adapters(setup):
    _, http, adapters, bad, prompts, _ = setup
    error = error_of(complete(http, "nope", prompts[0]), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'nope'" in error["message"]
    chat = http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert error_of(chat, 404)["code"] == "model_not_found"
    load = "/v1/load_lora_adapter"
    assert "another base model" in error_of(http.post(load, json={"lora_name": "o", "lora_path": bad["other_base"]}),
                                            400)["message"]
    assert "--max-lora-rank=16" in error_of(http.post(load, json={"lora_name": "r", "lora_path": bad["rank32"]}),
                                            400)["message"]
    assert "no adapter_config.json" in error_of(http.post(load, json={"lora_name": "m", "lora_path": "/nonexistent"}),
                                                400)["message"]
    assert "already served" in error_of(http.post(load, json={"lora_name": "a0", "lora_path": adapters["a0"][0]}),
                                        400)["message"]
    as_base = http.post(load, json={"lora_name": MODEL_NAME, "lora_path": adapters["a0"][0]})
    assert "base model's name" in error_of(as_base, 400)["message"]
    error_of(http.post(load, json={"lora_name": "x"}), 400)
    assert error_of(http.post("/v1/unload_lora_adapter", json={"lora_name": "zz"}), 404)["param"] == "lora_name"
    assert [c["id"] for c in http.get("/v1/models").json()["data"]][-1] != "o"


def test_unload_while_a_request_is_in_flight(setup):
    server, http, adapters, _, prompts, want = setup
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["a3"][0]})
    assert r.status_code == 200
    body = {"model": "late", "prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, unloaded = "", None
    with http.stream("POST", "/v1/completions", json=body) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            if unloaded is None:  # the request is running: unload its adapter now
                unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200 and "removed" in unloaded.text
    assert text == server.llm.tokenizer.decode(want["a3"][0])  # it finished on its adapter
    assert error_of(complete(http, "late", prompts[0]), 404)["code"] == "model_not_found"
    assert "late" not in [c["id"] for c in http.get("/v1/models").json()["data"]]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["a3"][0]})
    assert again.status_code == 200
    assert complete(http, "late", prompts[1]).json()["choices"][0]["text"] == server.llm.tokenizer.decode(
        want["a3"][1])
    swap = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["a2"][0],
                                                    "load_inplace": True})  # vLLM's: the name, new weights
    assert swap.status_code == 200
    assert complete(http, "late", prompts[1]).json()["choices"][0]["text"] == server.llm.tokenizer.decode(
        want["a2"][1])
    server.assert_all_blocks_free()
