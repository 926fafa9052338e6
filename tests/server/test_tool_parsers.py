"""The tool-call parsers on fixed replies: whole, and fed in pieces as a stream feeds them (every split gives the same
calls, and the streamed argument pieces concatenate to the final arguments)."""
import json

import pytest

from brrr.server.tool_parsers import TOOL_FORMATS, HermesParser, Llama3JsonParser, detect_tool_format, tool_delta

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}]{"}], "unit": "c\\"f"}}'


def whole(parser, text):
    parser.feed(text)
    parser.finish()
    return parser.result()


def streamed(parser, text, step):
    """Feed text in pieces of `step` characters; what a client assembles from the deltas."""
    content, calls = "", {}
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    for event in events:
        delta = tool_delta([event])
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert entry["id"] is None, "a call is opened once"
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def check_stream_matches(make_parser, text):
    content, calls = whole(make_parser(), text)
    for step in (1, 2, 5, len(text)):
        got_content, got_calls = streamed(make_parser(), text, step)
        assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in calls], step
        assert got_content == (content or ""), step
    return content, calls


def test_hermes_several_calls_after_text():
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" \
           '{"name": "now", "arguments": {}}\n</tool_call>\n'
    content, calls = check_stream_matches(HermesParser, text)
    assert content == "Let me look.\n"
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, {"x": "}]{"}], "unit": 'c"f'}
    assert calls[1].arguments == "{}"
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls) and calls[0].id != calls[1].id


def test_hermes_without_calls_is_all_content():
    text = "No tools needed: <tool and </tool_call> are just text, so is {\"name\": 1}"
    content, calls = check_stream_matches(HermesParser, text)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # a brace short
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # cut off inside nothing, but fine: see below
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} extra\n</tool_call>',  # text inside the block
    '<tool_call>\n{"na\\xme": "f", "arguments": {}}\n</tool_call>',  # a bad escape
    '<tool_call>\n{"name": "f\\q", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": "two\nlines"}}\n</tool_call>',  # a raw newline in a string
    'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "g", "argu',  # cut
])
def test_hermes_malformed_call_leaves_the_reply_as_content(text):
    content, calls = whole(HermesParser(), text)
    if text.endswith("{\"a\": 1}}"):  # a complete object whose </tool_call> never came (a forced call ends so)
        assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
        return
    assert (content, calls) == (text, [])


def test_hermes_forced_call_opened_by_the_prompt():
    content, calls = check_stream_matches(lambda: HermesParser(in_call=True), WEATHER)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert calls[0].arguments == WEATHER[WEATHER.index('{"city"'):-1]


def test_arguments_as_a_json_string():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
    content, calls = check_stream_matches(HermesParser, text)
    assert calls[0].arguments == '{"a": [1, 2]}'


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x;y"}}'
    content, calls = check_stream_matches(Llama3JsonParser, text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"b": "x;y"})]
    content, calls = check_stream_matches(Llama3JsonParser, '  {"name": "f", "parameters": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]


@pytest.mark.parametrize("text", ["Hello there", " {not json", '{"parameters": {"a": 1}, "x": ]'])
def test_llama3_json_content(text):
    """Wrong before any call was named: content, streamed or not."""
    content, calls = check_stream_matches(Llama3JsonParser, text)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("text, rest", [('{"name": "f", "parameters": {"a": 1}} trailing', "trailing"),
                                        ('{"name": "f", "parameters": {"a"', "")])
def test_llama3_json_malformed_after_the_name(text, rest):
    """The final message holds no broken call; a stream, which sent the call's start already, ends that call and
    sends what follows as content."""
    assert whole(Llama3JsonParser(), text) == (text, [])
    content, calls = streamed(Llama3JsonParser(), text, 3)
    assert [c["name"] for c in calls] == ["f"] and content == rest


def test_formats_read_from_templates():
    assert detect_tool_format("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}") is \
        TOOL_FORMATS["hermes"]
    llama = 'Respond in the format {"name": function name, "parameters": dictionary}. <|python_tag|>'
    assert detect_tool_format(llama) is TOOL_FORMATS["llama3_json"]
    assert detect_tool_format("{{ messages }}") is None and detect_tool_format(None) is None


def test_call_schema_follows_each_functions_parameters():
    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    one = TOOL_FORMATS["hermes"].call_schema([{"name": "f", "parameters": params}])
    assert one["properties"] == {"name": {"enum": ["f"]}, "arguments": params}
    assert one["required"] == ["name", "arguments"] and one["additionalProperties"] is False
    both = TOOL_FORMATS["llama3_json"].call_schema([{"name": "f", "parameters": params}, {"name": "g"}])
    assert [o["properties"]["name"] for o in both["anyOf"]] == [{"enum": ["f"]}, {"enum": ["g"]}]
    assert both["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_the_servers_format_from_flag_or_template():
    from brrr.default_model import default_model_dir
    from brrr.errors import BrrrError
    from brrr.server.app import tool_format
    from brrr.tokenizer import Tokenizer

    plain = Tokenizer.from_dir(default_model_dir())  # its template renders no tools
    assert tool_format(plain, None, False) is None
    assert tool_format(plain, "llama3_json", True) is TOOL_FORMATS["llama3_json"]
    with pytest.raises(BrrrError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_format(plain, None, True)
    with pytest.raises(BrrrError, match="--tool-call-parser must be one of hermes, llama3_json"):
        tool_format(plain, "mistral", False)
    plain.chat_template += "{% if tools %}<tool_call>{% endif %}"
    assert tool_format(plain, None, True) is TOOL_FORMATS["hermes"]


def test_arguments_before_the_name_wait_for_it():
    """A stream opens a call with its name: arguments written first are held until the name is known."""
    text = '<tool_call>{"arguments": {"q": [1, 2]}, "name": "search"}</tool_call>'
    content, calls = check_stream_matches(HermesParser, text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("search", '{"q": [1, 2]}')]
    events = []
    parser = HermesParser()
    for ch in text:
        events += parser.feed(ch)
    assert [e[0] for e in events][:2] == ["call", "args"]
