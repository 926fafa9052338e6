"""Tool-call parsers: a chat model's tool-call text -> OpenAI `tool_calls`, whole or while it streams.

Two model formats, named as vLLM's --tool-call-parser values:
- hermes (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly
  several, possibly after some text.
- llama3_json (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`, several separated by `;`,
  optionally after <|python_tag|>.

and the two shapes a grammar makes when the server forces a call on a model whose format it does not know (vLLM's
way: no parser needed): a JSON array of `{"name", "parameters"}` calls for tool_choice "required"
(CallArrayParser), and the arguments object alone for a named function (ArgumentsParser).

One incremental parser serves both paths: a non-streamed reply is fed whole, so the arguments a stream sends piece by
piece concatenate to exactly the final message's (the model's own text of the arguments object). A call whose JSON
is malformed or cut short leaves the whole reply as content in the final message, never broken JSON. A stream
cannot take back what it sent: there, the text of a call that went wrong before its name was complete is sent as
content, and one that went wrong after it simply ends.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
# events a parser returns: ("content", text) | ("call", index, id, name) | ("args", index, text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _CallScanner:
    """Reads one call's JSON object a character at a time: its name once that string closes, the text of its
    arguments value as it grows, and where the object ends. It checks the structure (strings, bracket nesting, the
    top-level keys); json.loads checks the rest once the object is complete."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self):
        self.text = ""
        self.state = "start"  # start | key_or_end | key | colon | value | nested | string | primitive | after | done
        self.bad = False
        self.stack: list[str] = []  # open brackets inside the current top-level value
        self.in_string = self.escape = False
        self.token_start = 0  # where the current key or value began in text
        self.key: str | None = None
        self.values: dict[str, tuple[int, int]] = {}  # top-level key -> (start, end) of its value in text
        self.name: str | None = None
        self.args_key: str | None = None
        self.args_start: int | None = None

    def feed(self, text: str) -> int:
        """Consume characters until the object ends or goes wrong; returns how many were consumed."""
        base = len(self.text)
        self.text += text  # whole, then cut back: one copy per piece, not per character
        for i, ch in enumerate(text):
            if self.state == "done" or self.bad:
                self.text = self.text[:base + i]
                return i
            self._step(ch, base + i)
        return len(text)

    def _fail(self) -> None:
        self.bad = True

    def _string(self, start: int, end: int) -> str | None:
        try:
            return json.loads(self.text[start:end])
        except ValueError:  # a bad escape
            self._fail()
            return None

    def _step(self, ch: str, at: int) -> None:  # noqa: C901 - one small state machine
        state = self.state
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if state == "key":
                    self.key = self._string(self.token_start, at + 1)
                    self.state = "colon"
                elif state == "string":
                    self._end_value(at + 1)
            elif ch < " ":  # a raw control character (a newline) cannot be inside a JSON string
                self._fail()
            return
        if state == "nested":
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.stack.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if ch != self.stack.pop():
                    self._fail()
                elif not self.stack:
                    self._end_value(at + 1)
            return
        if state == "primitive":
            if ch not in WHITESPACE + ",}":
                return
            self._end_value(at)
            state = self.state  # the character after the primitive is read as what follows a value
        if ch in WHITESPACE:
            return
        if state == "start":
            if ch != "{":
                self._fail()
            self.state = "key_or_end"
        elif state in ("key_or_end", "key") and ch == '"':
            self.state, self.in_string, self.token_start = "key", True, at
        elif state == "colon" and ch == ":":
            self.state = "value"
        elif state == "value":
            if self.key in self.values or (self.key in self.ARG_KEYS and self.args_key is not None):
                return self._fail()  # a key twice: json.loads would keep the last, the stream sent the first
            self.token_start = at
            if self.key in self.ARG_KEYS:
                if ch not in '{"':
                    return self._fail()  # arguments are an object (or a string holding one)
                self.args_key, self.args_start = self.key, at
            if ch in "{[":
                self.state, self.stack = "nested", ["}" if ch == "{" else "]"]
            elif ch == '"':
                self.state, self.in_string = "string", True
            else:
                self.state = "primitive"
        elif state in ("after", "key_or_end") and ch == "}":
            self._finish_object(at + 1)
        elif state == "after" and ch == ",":
            self.state = "key"
        else:
            self._fail()

    def _end_value(self, end: int) -> None:
        self.values[self.key] = (self.token_start, end)
        self.state = "after"
        if self.key == "name":
            name = self._string(self.token_start, end) if self.text[self.token_start] == '"' else None
            if not isinstance(name, str) or not name:
                self._fail()
            self.name = name

    def _finish_object(self, end: int) -> None:
        self.state = "done"
        try:
            json.loads(self.text[:end])
        except ValueError:
            return self._fail()
        if self.name is None or self.args_text(final=True) is None:
            self._fail()

    @property
    def done(self) -> bool:
        return self.state == "done" and not self.bad

    def args_text(self, final: bool = False) -> str | None:
        """The arguments' JSON text known so far (a prefix of the final one); final: the whole of it ("{}" when the
        call has none), or None if it is not a JSON object."""
        if self.args_key is None:
            return "{}" if final else ""
        start, end = self.values.get(self.args_key, (self.args_start, None))
        if self.text[start] == "{":
            return self.text[start:end]
        if not final:  # a string holding the JSON: sent whole at the end
            return ""
        inner = json.loads(self.text[start:end])
        try:
            ok = isinstance(json.loads(inner), dict)
        except ValueError:
            ok = False
        return inner if ok else None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


class ToolCallParser:
    """Feed the reply's text as it arrives (feed), then end it (finish); both return events to stream. result()
    gives the final message's content and calls. Subclasses read the text around the calls."""

    def __init__(self):
        self.all_text = ""
        self.mode = "text"  # "ended": the calls allowed are all made, and what follows is dropped
        self.max_calls: int | None = None  # parallel_tool_calls false: 1
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.malformed = False  # a call went wrong: the final message is all content
        self.scanner: _CallScanner | None = None

    # ---- the open call ----------------------------------------------------------------------------------------
    def _open_call(self, opening: str) -> None:
        """opening: the text that started the call, sent as content if the call goes wrong before it is named."""
        self.scanner, self.opening, self.call_id, self.sent_args = _CallScanner(), opening, None, 0

    def _feed_call(self, text: str, events: list) -> str | None:
        """Feed the open call; the text after its end once it ends, else None (still open, or gone wrong)."""
        scanner = self.scanner
        used = scanner.feed(text)
        if scanner.bad:
            self._call_failed(text[used:], events)
            return None
        index = len(self.calls)
        if self.call_id is None and scanner.name is not None:
            self.call_id = new_call_id()
            events.append(("call", index, self.call_id, scanner.name))
        if self.call_id is not None:
            args = scanner.args_text(final=scanner.done)
            if len(args) > self.sent_args:
                events.append(("args", index, args[self.sent_args:]))
                self.sent_args = len(args)
        if not scanner.done:
            return None
        self.calls.append(ToolCall(self.call_id, scanner.name, scanner.args_text(final=True)))
        self.scanner = None
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.mode = "ended"
            return None
        return text[used:]

    def _call_failed(self, rest: str, events: list) -> None:
        self.malformed, self.mode = True, "plain"
        if self.call_id is None:
            self._content(self.opening + self.scanner.text, events)
        self.scanner = None
        self._content(rest, events)

    def _content(self, text: str, events: list) -> None:
        if text:
            self.content.append(text)
            events.append(("content", text))

    # ---- the interface ----------------------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self.all_text += text
        events: list = []
        if self.mode == "plain":
            self._content(text, events)
        elif self.mode != "ended":
            self._feed(text, events)
        return events

    def finish(self) -> list:
        events: list = []
        if self.scanner is not None:  # cut short inside a call
            self._call_failed("", events)
        elif self.mode not in ("plain", "ended"):
            self._finish(events)
        return events

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of the final message: the reply as content and no calls if any call went wrong."""
        if self.malformed or not self.calls:
            return self.all_text, []
        return ("".join(self.content) or None), self.calls

    def _feed(self, text: str, events: list) -> None:
        raise NotImplementedError

    def _finish(self, events: list) -> None:
        raise NotImplementedError


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    """Text, then `<tool_call>` JSON `</tool_call>` blocks. Whitespace between and after calls is dropped; text
    before the first call is content as it is. in_call: the prompt already opened the first call (a forced call)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, in_call: bool = False):
        super().__init__()
        self.held = ""  # text that may still turn out to be a tag, or whitespace between calls
        if in_call:
            self.mode = "call"
            self._open_call("")

    def _feed(self, text: str, events: list) -> None:
        while text:
            if self.mode == "call":
                rest = self._feed_call(text, events)
                if rest is None:
                    return
                self.mode, text = "after_call", rest
            elif self.mode == "after_call":  # whitespace, then </tool_call>
                self.held += text
                body = self.held.lstrip(WHITESPACE)
                if self.END.startswith(body):
                    return
                if not body.startswith(self.END):
                    self.malformed, self.mode, self.held = True, "plain", ""
                    return self._content(body, events)
                self.mode, text, self.held = "text", body[len(self.END):], ""
            elif self.mode == "text":
                self.held += text
                at = self.held.find(self.START)
                if at < 0:
                    cut = len(self.held) - _partial_suffix(self.held, self.START)
                    if self.calls:  # whitespace after a call waits to see what follows it
                        cut = len(self.held[:cut].rstrip(WHITESPACE))
                    ready, self.held = self.held[:cut], self.held[cut:]
                    return self._content(ready, events)
                before, text = self.held[:at], self.held[at + len(self.START):]
                if not (self.calls and not before.strip(WHITESPACE)):
                    self._content(before, events)
                self.held, self.mode = "", "call"
                self._open_call(self.START)
            else:
                return self._content(text, events)

    def _finish(self, events: list) -> None:
        held, self.held = self.held, ""
        if self.mode == "text" and not (self.calls and not held.strip(WHITESPACE)):
            self._content(held, events)


class Llama3JsonParser(ToolCallParser):
    """The whole reply is calls (`{"name": ..., "parameters": ...}`, `;` between them, <|python_tag|> optional in
    front), or it is all content."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.held, self.mode = "", "lead"

    def _feed(self, text: str, events: list) -> None:
        while text:
            if self.mode == "lead":  # whitespace, then the tag or "{" (calls) or anything else (content)
                self.held += text
                body = self.held.lstrip(WHITESPACE)
                if not body or (self.TAG.startswith(body) and body != self.TAG):
                    return
                if body.startswith(self.TAG):
                    body = body[len(self.TAG):]
                elif not body.startswith("{"):
                    self.mode, held, self.held = "plain", self.held, ""
                    return self._content(held, events)
                opening, self.held, self.mode, text = self.held[:len(self.held) - len(body)], "", "call", body
                self._open_call(opening)
            elif self.mode == "call":
                rest = self._feed_call(text, events)
                if rest is None:
                    return
                self.mode, text = "between", rest
            elif self.mode == "between":  # whitespace, then ";" and the next call
                body = text.lstrip(WHITESPACE)
                if not body:
                    return
                if body[0] != ";":
                    self.malformed, self.mode = True, "plain"
                    return self._content(body, events)
                self.mode, text = "call", body[1:]
                self._open_call("")
            else:
                return self._content(text, events)

    def _finish(self, events: list) -> None:
        if self.mode == "lead":
            self._content(self.held, events)
        self.held = ""


class CallArrayParser(ToolCallParser):
    """The reply is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`: what the grammar of a
    forced "required" call makes when the model's own format is unknown."""

    def __init__(self):
        super().__init__()
        self.mode = "lead"

    def _feed(self, text: str, events: list) -> None:
        while text:
            if self.mode in ("lead", "between"):  # "[" first; then "," (another call) or "]"
                body = text.lstrip(WHITESPACE)
                if not body:
                    return
                wanted = "[" if self.mode == "lead" else ",]"
                if body[0] not in wanted:
                    self.malformed, self.mode = True, "plain"
                    return self._content(body, events)
                if body[0] == "]":
                    self.mode = "ended"
                    return
                self.mode, text = "call", body[1:]
                self._open_call("")
            elif self.mode == "call":
                rest = self._feed_call(text, events)
                if rest is None:
                    return
                self.mode, text = "between", rest
            else:
                return self._content(text, events)

    def _finish(self, events: list) -> None:
        self.malformed = True  # ended before its "]": cut short


class ArgumentsParser:
    """The reply is the arguments object of one call to a function the request named: what the grammar of a forced
    named call makes when the model's own format is unknown. The server names the call; the text streams as the
    call's arguments."""

    def __init__(self, name: str):
        self.name, self.call_id, self.all_text = name, new_call_id(), ""

    def feed(self, text: str) -> list:
        events = [] if self.all_text or not text else [("call", 0, self.call_id, self.name)]
        self.all_text += text
        return events + ([("args", 0, text)] if text else [])

    def finish(self) -> list:
        return []

    def result(self) -> tuple[str | None, list[ToolCall]]:
        try:
            whole = isinstance(json.loads(self.all_text), dict)
        except ValueError:  # cut short by max_tokens
            whole = False
        return (None, [ToolCall(self.call_id, self.name, self.all_text)]) if whole else (self.all_text, [])


def tool_delta(events: list) -> dict:
    """A tool-call parser's events as one chat delta: the content they release, and per call its opening chunk
    (index, id, type, name) and the arguments text that is new."""
    delta, calls = {}, {}
    for event in events:
        if event[0] == "content":
            delta["content"] = delta.get("content", "") + event[1]
        elif event[0] == "call":
            _, index, call_id, name = event
            calls[index] = {"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}
        else:
            _, index, text = event
            calls.setdefault(index, {"index": index, "function": {"arguments": ""}})["function"]["arguments"] += text
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


# ---- the formats ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # the key this format's calls hold the arguments under
    # appended to the prompt for a forced call: what the model itself opens a call with, so the constrained text that
    # follows is the JSON of the call alone (a JSON schema can say that; no grammar dialect needed)
    forced_opening: str
    parser_class: type
    # the format's markers may be special tokens (Hermes 2 Pro's <tool_call>), which a reply read for calls must keep
    keeps_special_tokens: bool = False

    def parser(self, forced: bool, parallel: bool = True) -> ToolCallParser:
        parser = HermesParser(in_call=True) if forced and self.parser_class is HermesParser else self.parser_class()
        parser.max_calls = None if parallel else 1
        return parser

    def call_schema(self, functions: list[dict]) -> dict:
        """The JSON schema of one call to one of these functions (OpenAI `function` objects), its arguments
        following the function's parameters schema."""
        options = []
        for f in functions:
            params = f.get("parameters") or {"type": "object", "properties": {}}
            options.append({"type": "object", "properties": {"name": {"enum": [f["name"]]}, self.args_key: params},
                            "required": ["name", self.args_key], "additionalProperties": False})
        return options[0] if len(options) == 1 else {"anyOf": options}


def call_array_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of CallArrayParser's array: one call at least, one at most unless parallel."""
    schema = {"type": "array", "items": ToolFormat("", "parameters", "", CallArrayParser).call_schema(functions),
              "minItems": 1}
    return schema if parallel else {**schema, "maxItems": 1}


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", HermesParser.START + "\n", HermesParser, keeps_special_tokens=True),
    "llama3_json": ToolFormat("llama3_json", "parameters", "", Llama3JsonParser),
}


def detect_tool_format(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template teaches its model, read from the template's own text (None: not one brrr knows)."""
    template = chat_template or ""
    if HermesParser.START in template:
        return TOOL_FORMATS["hermes"]
    if '"parameters"' in template and (Llama3JsonParser.TAG in template or "ipython" in template):
        return TOOL_FORMATS["llama3_json"]
    return None
