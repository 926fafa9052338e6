"""Tool calling through the server with the Hermes-style test template (conftest.TOOLS_TEMPLATE). A forced call
("required" or a named function) needs the engine's guided decoding: the tiny model's free text is noise, so every
call that parses and validates does so because of the constraint."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from brrr.config import EngineConfig
from tests.server.conftest import API_KEY, MODEL_NAME, serve, start_engine
from tests.server.test_errors import error_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_calls(message, names):
    assert message.tool_calls and message.content is None, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_calls_validate(client):
    def ask(seed):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=seed,
                                              tool_choice="required", temperature=1.0, max_tokens=200, n=4)

    with ThreadPoolExecutor(4) as pool:
        choices = [c for r in pool.map(ask, range(5)) for c in r.choices]
    for choice in choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, {"get_weather", "now"})
    assert {c.message.tool_calls[0].function.name for c in choices} == {"get_weather", "now"}


def test_named_function_streamed_equals_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               seed=seed, max_tokens=200).choices[0]
        assert whole.finish_reason == "tool_calls"
        check_calls(whole.message, {"get_weather"})
        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                     tool_choice=choice, seed=seed, max_tokens=200, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        calls = [d for delta in deltas for d in delta.tool_calls or []]
        opening = [d for d in calls if d.id is not None]
        assert len(opening) == 1 and opening[0].index == 0 and opening[0].type == "function"
        assert opening[0].function.name == "get_weather" and all(d.index == 0 for d in calls)
        streamed = "".join(d.function.arguments or "" for d in calls)
        assert len([d for d in calls if d.function.arguments]) > 1  # the arguments arrive as they are generated
        assert streamed == whole.message.tool_calls[0].function.arguments
        assert not any(d.content for d in deltas)
        # no empty chunks while the parser holds back the call's opening text
        assert all(c.choices[0].delta.tool_calls or c.choices[0].finish_reason or c.choices[0].delta.role
                   for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_history_with_tool_calls_renders(client, server):
    """A client sends the call back with the tool's answer; the template renders both (arguments as an object)."""
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=1,
                                           tool_choice="required", max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    history = MESSAGES + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(server.base_url + "/tokenize", json={"messages": history, "tools": TOOLS},
                        headers=headers).json()["tokens"]
    text = server.llm.tokenizer.decode(tokens, skip_special_tokens=False)
    assert json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                      ensure_ascii=False) in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "now"' in text
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=3)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tokens)  # the chat prompt is the template's, tools included


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": "zero"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_name_the_field(server, extra, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param, error


@pytest.fixture(scope="module")
def auto_server(model_dir, pretrained):
    """A server started with --enable-auto-tool-choice (the format read from the template)."""
    llm = start_engine(model_dir, pretrained, EngineConfig(num_blocks=128), in_thread=True)
    with serve(llm, model_dir, enable_auto_tool_choice=True) as running:
        yield running


def test_auto_reads_calls_out_of_free_text(auto_server):
    """Free noise holds no call: "auto" gives the same content as "none"; a reply constrained to be text and then a
    Hermes call gives the parsed call, streamed and not."""
    client = openai.OpenAI(base_url=auto_server.base_url + "/v1", api_key="x", max_retries=0)
    # a reply read for hermes calls keeps special tokens (the markers may be special), so "none" must too to compare
    replies = [client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                              temperature=0, tool_choice=choice,
                                              extra_body={"skip_special_tokens": False}).choices[0].message
               for choice in ("auto", "none")]
    assert replies[0].content == replies[1].content and replies[0].tool_calls is None
    # a reply that is a call: force its text token by token through the regex constraint
    text = 'Sure.\n<tool_call>\n{"name": "now", "arguments": {"zone": "utc"}}\n</tool_call>'
    pattern = text.replace("{", "\\{").replace("}", "\\}").replace(".", "\\.")
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": pattern}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure.\n"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("now", '{"zone": "utc"}')]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure.\n"
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in calls) == '{"zone": "utc"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"



def test_llama3_json_format_by_flag(model_dir, pretrained):
    """--tool-call-parser llama3_json: a forced call is the bare JSON `{"name", "parameters"}`, parsed back into
    tool_calls, streamed the same."""
    llm = start_engine(model_dir, pretrained, EngineConfig(num_blocks=128), in_thread=True)
    with serve(llm, model_dir, tool_call_parser="llama3_json") as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="x", max_retries=0)
        for seed in range(3):
            kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed,
                          max_tokens=200)
            whole = client.chat.completions.create(**kwargs).choices[0]
            assert whole.finish_reason == "tool_calls"
            check_calls(whole.message, {"get_weather", "now"})
            chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
            calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
            assert [d.function.name for d in calls if d.id] == [whole.message.tool_calls[0].function.name]
            assert "".join(d.function.arguments or "" for d in calls) == whole.message.tool_calls[0].function.arguments


def test_openai_clients_stream_helper_assembles_the_call(client):
    """The client's own accumulator (chat.completions.stream) rebuilds the call from our deltas and parses the
    arguments into the tool's pydantic model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Lookup(BaseModel):
        word: str = Field(max_length=6)
        lang: Literal["en", "fr"]

    tool = openai.pydantic_function_tool(Lookup)
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=[tool], seed=3, max_tokens=100,
                                        tool_choice={"type": "function", "function": {"name": "Lookup"}}) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments, Lookup)
    assert final.choices[0].finish_reason == "tool_calls"
