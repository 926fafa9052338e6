"""A tiny random model with a chat template, and real uvicorn servers on 127.0.0.1 (port 0) in background threads."""
import threading
import time
from contextlib import contextmanager

import pytest

from brrr.config import EngineConfig
from brrr.engine import AsyncLLM, LLMEngine
from brrr.pretrained import load
from tests import hf_models

MODEL_NAME = "tiny"
API_KEY = "test-key"
CONTEXT = 2048


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-model")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=CONTEXT), path)
    return path


@pytest.fixture(scope="session")
def pretrained(model_dir):
    return load(model_dir, dtype="float32", device="cpu")


class RunningServer:
    def __init__(self, base_url, engine, llm):
        self.base_url, self.engine, self.llm = base_url, engine, llm

    def wait_idle(self, timeout=10.0):
        """Until the engine has applied every abort and holds no request (the engine thread is asynchronous)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() or self.engine.scheduler.num_unfinished:
            assert time.monotonic() < deadline, "the engine still holds requests"
            time.sleep(0.01)


@contextmanager
def serve(pretrained, engine_config=None, **app_kwargs):
    import uvicorn

    from brrr.server import create_app

    engine = LLMEngine(pretrained.model, pretrained.tokenizer, engine_config or EngineConfig(num_blocks=512),
                       pretrained.eos_token_ids)
    llm = AsyncLLM(engine)
    app = create_app(llm, pretrained.tokenizer, MODEL_NAME, model_path=pretrained.path, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, llm)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()


@pytest.fixture(scope="session")
def server(pretrained):
    """The shared server: API key required, 64 KiB body limit, 512 KV blocks of 16 tokens."""
    with serve(pretrained, api_key=API_KEY, max_body_bytes=64 << 10) as running:
        yield running


@pytest.fixture(scope="session")
def offline(model_dir):
    from brrr.engine import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu")
