"""What a request asks the engine to constrain, as StructuredOutputsParams, with the body field a 400 about it names:
OpenAI's response_format, vLLM's structured_outputs and guided_* fields, and the forced tool call of tool_choice
"required" or a named function. Also how a chat request uses its tools (ToolUse)."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from brrr.errors import BrrrError
from brrr.sampling_params import StructuredOutputsParams
from brrr.server.protocol import APIError, ChatCompletionRequest
from brrr.server.tool_parsers import ArgumentsParser, CallArrayParser, ToolFormat, call_array_schema

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older names for structured_outputs' fields


@dataclass
class Constraint:
    params: StructuredOutputsParams
    field: str  # the body field it came from (response_format.json_schema.schema, guided_regex, tools, ...)

    def error(self, e: BrrrError) -> APIError | None:
        """The engine's complaint about this constraint ("structured_outputs.json: why") as a 400 naming the body
        field; None if the error is about something else."""
        message = str(e)
        if not message.startswith("structured_outputs"):
            return None
        why = re.sub(r"^structured_outputs(\.\w+)?:?\s*", "", message)
        return APIError(400, f"{self.field}: {why}", param=self.field, code="invalid_value")


def _constraint(field: str, **value) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**value), field)
    except BrrrError as e:
        raise Constraint(None, field).error(e) or APIError(400, f"{field}: {e}", param=field) from None


def body_constraints(body) -> list[Constraint]:
    """Every constraint the body sets (a request may set one: the caller checks)."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(_constraint("response_format", json_object=True))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            field = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
            raise APIError(400, f"{field} is required when response_format.type is 'json_schema'", param=field,
                           code="missing_field")
        found.append(_constraint("response_format.json_schema.schema", json=fmt.json_schema.schema_))
    so = body.structured_outputs
    if so is not None:
        chosen = {name: value for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                  ("grammar", so.grammar), ("json_object", so.json_object or None))
                  if value is not None}
        if len(chosen) != 1:
            raise APIError(400, "structured_outputs must set exactly one of json, regex, choice, grammar, "
                           f"json_object; got {sorted(chosen) or 'none'}", param="structured_outputs",
                           code="invalid_value")
        ((name, value),) = chosen.items()
        found.append(_constraint(f"structured_outputs.{name}", **{name: value}))
    for field, name in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append(_constraint(field, **{name: value}))
    return found


# ---- tools ------------------------------------------------------------------------------------------------------
@dataclass
class ToolUse:
    make_parser: Callable[[], object] | None  # a fresh tool-call parser for each choice; None: the reply is text
    constraint: Constraint | None = None  # a forced call's grammar
    opening: str = ""  # appended to the prompt: the model's own opening of a forced call in its format
    keeps_special_tokens: bool = False  # the parser must see special tokens (Hermes 2 Pro's <tool_call>)

    def parser(self):
        return self.make_parser() if self.make_parser else None


def tool_use(body: ChatCompletionRequest, fmt: ToolFormat | None, auto_tool_choice: bool) -> ToolUse | None:
    """How the request uses its tools (None: it has none), or a 400 naming the field that is wrong. A forced call
    ("required" or a named function) is made by a grammar, so it needs no parser: in the model's own format when
    that is known (read from the chat template or --tool-call-parser; one call), else as vLLM does it, the grammar
    writing a JSON array of calls ("required"; one call when parallel_tool_calls is false) or the named function's
    arguments, which the server turns into tool_calls. Only "auto" reads calls out of free text, with a parser."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice",
                           code="invalid_value")
        return None
    names = {}
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if name in names:
            raise APIError(400, f"tools.{i}.function.name: {name!r} is also the name of tools.{names[name]}",
                           param=f"tools.{i}.function.name", code="invalid_value")
        names[name] = i
    choice = choice or "auto"
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolUse(None)
    if choice == "auto":
        if not auto_tool_choice or fmt is None:
            raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice (and '
                           "--tool-call-parser unless the chat template's format is known); tool_choice "
                           '"required", a named function and "none" work without it', param="tool_choice",
                           code="invalid_value")
        return ToolUse(lambda: fmt.parser(False, parallel), keeps_special_tokens=fmt.keeps_special_tokens)
    if choice == "required":
        functions, field = [t.function.model_dump(exclude_none=True) for t in body.tools], "tools"
    else:
        name = choice.function.name
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools "
                           f"({', '.join(map(repr, names))})", param="tool_choice", code="invalid_value")
        functions = [body.tools[names[name]].function.model_dump(exclude_none=True)]
        field = f"tools.{names[name]}.function.parameters"
    if fmt is not None:
        return ToolUse(lambda: fmt.parser(True), _constraint(field, json=fmt.call_schema(functions)),
                       fmt.forced_opening, fmt.keeps_special_tokens)
    if choice == "required":
        return ToolUse(CallArrayParser, _constraint(field, json=call_array_schema(functions, parallel)))
    arguments = functions[0].get("parameters") or {"type": "object", "properties": {}}
    return ToolUse(lambda: ArgumentsParser(functions[0]["name"]), _constraint(field, json=arguments))


def request_constraint(body, tools: ToolUse | None = None) -> Constraint | None:
    """The one constraint of the request, or a 400 when it sets several."""
    found = body_constraints(body)
    if tools is not None and tools.constraint is not None:
        found.append(tools.constraint)
    if len(found) > 1:
        names = [re.sub(r"\..*", "", c.field) if not c.field.startswith("tools") else "tool_choice" for c in found]
        raise APIError(400, f"{names[1]}: only one constraint per request; this one also sets {names[0]}",
                       param=names[1], code="invalid_value")
    return found[0] if found else None
