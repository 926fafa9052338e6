"""The clients people already run, against the plain-template server (no --tool-call-parser, as a new user starts
it): forced tool calls made by the grammar and built into tool_calls by the server, the README's snippet as
written, instructor (JSON-schema and tools modes), LangChain's with_structured_output and bind_tools, and the
OpenAI agents SDK's chat-completions model running a tool loop. The tiny model's free text is noise, so every object
that validates does so because of the constraint."""
import asyncio
import json
import re
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from brrr.config import EngineConfig
from tests.server.conftest import CLIENTS_MODEL, serve, start_engine

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false: the noise model writes no extra keys
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=10**6)
    size: Literal["small", "big"]


@pytest.fixture(scope="module")
def client(clients_server):
    return openai.OpenAI(base_url=clients_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(message, names):
    assert message.tool_calls and message.content is None, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


# ---- forced calls without a parser --------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [None, False])
def test_required_without_a_parser(client, parallel):
    # no max_tokens: the noise model writes "," or "]" after each call at random, several calls at times
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    counts = []
    for seed in range(4):
        whole = client.chat.completions.create(model=CLIENTS_MODEL, messages=MESSAGES, tools=TOOLS, seed=seed,
                                               tool_choice="required", **extra).choices[0]
        assert whole.finish_reason == "tool_calls"
        check_calls(whole.message, {"get_weather", "now"})
        counts.append(len(whole.message.tool_calls))
        chunks = [c for c in client.chat.completions.create(model=CLIENTS_MODEL, messages=MESSAGES, tools=TOOLS,
                                                            seed=seed, tool_choice="required", stream=True,
                                                            **extra) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        streamed = {}
        for d in deltas:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        assert [tuple(streamed[i]) for i in sorted(streamed)] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks)
    assert min(counts) >= 1 and (parallel is not False or max(counts) == 1), counts


def test_named_function_without_a_parser(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        whole = client.chat.completions.create(model=CLIENTS_MODEL, messages=MESSAGES, tools=TOOLS, seed=seed,
                                               tool_choice=choice, max_tokens=200).choices[0]
        assert whole.finish_reason == "tool_calls"
        check_calls(whole.message, {"get_weather"})
        assert len(whole.message.tool_calls) == 1
        chunks = [c for c in client.chat.completions.create(model=CLIENTS_MODEL, messages=MESSAGES, tools=TOOLS,
                                                            seed=seed, tool_choice=choice, max_tokens=200,
                                                            stream=True) if c.choices]
        calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in calls if d.id] == ["get_weather"]
        assert len([d for d in calls if d.function.arguments]) > 1  # the arguments stream as they are made
        assert "".join(d.function.arguments or "" for d in calls) == whole.message.tool_calls[0].function.arguments


def test_auto_without_a_parser_says_what_it_needs(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=CLIENTS_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert "--enable-auto-tool-choice" in e.value.message and e.value.body["param"] == "tool_choice"


def test_readme_snippet_runs_as_written(clients_server, capsys):
    """The README's Python block (completion, json_schema, tool call), pointed at this server's port."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "tool_choice" in b]
    exec(block.replace("http://127.0.0.1:8000/v1", clients_server.base_url + "/v1"), {})
    *_, arguments = capsys.readouterr().out.strip().splitlines()
    assert isinstance(json.loads(arguments)["city"], str)


# ---- instructor ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    for seed in range(2):
        city = patched.chat.completions.create(model=CLIENTS_MODEL, response_model=City, max_retries=0, seed=seed,
                                               messages=[{"role": "user", "content": "Largest city in France?"}],
                                               max_tokens=200)
        assert isinstance(city, City)


# ---- LangChain ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(clients_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=CLIENTS_MODEL, base_url=clients_server.base_url + "/v1",
                                       api_key="unused", max_tokens=200, max_retries=0, seed=1)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    out = chat_model.with_structured_output(City, method=method, strict=True).invoke("Largest city in France?")
    assert isinstance(out, City)


def test_langchain_bind_tools(chat_model):
    from langchain_core.tools import tool

    @tool
    def now(zone: Literal["utc", "local"]) -> str:
        """The time now in a zone."""
        return "12:00"

    # strict: LangChain writes additionalProperties false (else the noise model adds keys of its own)
    message = chat_model.bind_tools([now], tool_choice="required", strict=True).invoke("What time is it?")
    assert message.tool_calls and all(c["name"] == "now" and c["args"]["zone"] in ("utc", "local")
                                      for c in message.tool_calls)


# ---- the OpenAI agents SDK ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auto_server(plain_model_dir):
    """The plain template with --tool-call-parser hermes --enable-auto-tool-choice: what an agent loop needs, whose
    turns after the first tool call use "auto"."""
    llm = start_engine(plain_model_dir, None, EngineConfig(num_blocks=128))
    with serve(llm, plain_model_dir, CLIENTS_MODEL, tool_call_parser="hermes", enable_auto_tool_choice=True) as running:
        yield running


def test_agents_sdk_tool_loop(auto_server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
    seen = []

    @agents.function_tool
    def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in Paris."""
        seen.append(unit)
        return "sunny, 21 degrees"

    client = openai.AsyncOpenAI(base_url=auto_server.base_url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                         model=agents.OpenAIChatCompletionsModel(model=CLIENTS_MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What's the weather in Paris?", max_turns=4))
    # turn 1: the forced call; the tool runs; turn 2 ("auto" after the SDK resets tool_choice): the reply
    assert seen and seen[0] in ("celsius", "fahrenheit")
    assert len(result.raw_responses) == 2 and isinstance(result.final_output, str)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == ["sunny, 21 degrees"]
