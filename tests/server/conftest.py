"""A tiny random model with a chat template, and real uvicorn servers on 127.0.0.1 (port 0) in background threads,
their engines in a process of their own (as `brrr serve` runs) or, where a test reaches into the engine, in a
thread."""
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from brrr.config import EngineConfig
from brrr.engine import AsyncLLM, LLMEngine
from brrr.engine.engine_process import EngineSpec
from brrr.pretrained import load
from tests import hf_models

# The default chat template plus tools in the Hermes/Qwen style: a system turn listing them, assistant turns with
# <tool_call> blocks, tool results as <tool_response>. Without tools it renders exactly as the default template.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}{% for call in message.tool_calls %}"
    "{{ '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + "
    "'\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_NAME = "tiny"
API_KEY = "test-key"
CONTEXT = 2048
LINUX = Path("/proc/self/stat").exists()  # tests that look for processes read /proc


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-model")
    hf_models.save_tokenizer(path, chat_template=TOOLS_TEMPLATE)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=CONTEXT), path)
    return path


@pytest.fixture(scope="session")
def pretrained(model_dir):
    return load(model_dir, dtype="float32", device="cpu")


class RunningServer:
    def __init__(self, base_url, llm):
        self.base_url, self.llm = base_url, llm

    @property
    def engine(self):
        """The LLMEngine object when the engine runs in a thread of this process; None for an engine process."""
        return self.llm.engine

    def stats(self) -> dict:
        return self.llm.stats()

    def wait_idle(self, timeout=10.0) -> dict:
        """Until the engine has applied every abort and holds no request (it runs asynchronously). Its stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.llm.stats()
            if stats["num_unfinished_requests"] == 0 and stats["num_unfinished_seqs"] == 0:
                return stats
            assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
            time.sleep(0.01)

    def assert_all_blocks_free(self, timeout=10.0) -> None:
        stats = self.wait_idle(timeout)
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
        if self.engine is not None:
            self.engine.block_manager.check_invariants([])


def start_engine(model_dir, pretrained, engine_config=None, in_thread=False):
    """An engine process built from the model directory (as `brrr serve` does), or, in_thread, the engine loop on
    an engine object in a thread of this process (faster to start; tests that reach into the engine)."""
    config = engine_config or EngineConfig(num_blocks=512)
    if in_thread:
        return AsyncLLM(LLMEngine(pretrained.model, pretrained.tokenizer, config, pretrained.eos_token_ids))
    return AsyncLLM.spawn(EngineSpec(str(model_dir), "float32", "cpu", config, cpu_threads=1, log_level="WARNING"))


@contextmanager
def serve(llm, model_path, model_name=MODEL_NAME, **app_kwargs):
    """uvicorn on 127.0.0.1 (a free port) in a thread, serving llm, which it shuts down at the end."""
    import uvicorn

    from brrr.server import create_app

    app = create_app(llm, llm.tokenizer, model_name, model_path=model_path, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", llm)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()


@pytest.fixture(scope="session")
def server(model_dir, pretrained):
    """The shared server, its engine in a process of its own: API key required, 64 KiB body limit, 512 KV blocks of
    16 tokens."""
    with serve(start_engine(model_dir, pretrained), model_dir, api_key=API_KEY, max_body_bytes=64 << 10) as running:
        yield running


@pytest.fixture(scope="session")
def thread_server(model_dir, pretrained):
    """The same, with the engine loop in a thread of this process on an engine object tests can reach into."""
    with serve(start_engine(model_dir, pretrained, in_thread=True), model_dir, api_key=API_KEY,
               max_body_bytes=64 << 10) as running:
        yield running


CLIENTS_MODEL = "llama-1b"  # the name the README's examples use, so its snippets run here as written


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory):
    """A tiny llama with brrr's default chat template, which shows no tool-call format (like most plain templates),
    saved as transformers saves one (lm-eval's own hf backend loads it)."""
    path = tmp_path_factory.mktemp("plain-model")
    hf_models.save_tokenizer(path)
    hf_models.save(hf_models.build("llama3-rope", vocab_size=320, max_position_embeddings=CONTEXT), path)
    return path


@pytest.fixture(scope="session")
def clients_server(plain_model_dir):
    """The server the third-party clients (lm-eval, instructor, LangChain, the agents SDK) share: the plain
    template's model, its engine in a process of its own, no API key, served as CLIENTS_MODEL."""
    with serve(start_engine(plain_model_dir, None), plain_model_dir, CLIENTS_MODEL) as running:
        yield running


@pytest.fixture(scope="session")
def offline(model_dir):
    from brrr.engine import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu")


def engine_processes(server_pid: int) -> list[int]:
    """The live engine processes a `brrr serve` started (Linux: read from /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(parent) == server_pid and state != "Z" and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by whoever adopts it, which may take a while)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
