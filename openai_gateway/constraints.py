"""Constraints: what a request's `response_format`, `structured_outputs` (vLLM's extension) or
forced `tool_choice` asks of the output, as the SDK's constraint keywords (json_schema,
json_object, regex, choice, grammar). The worker compiles them and refuses, with a 400 here, a
constraint its grammar engine cannot hold whole.

A forced tool choice is a JSON schema: a named function's output is its arguments; "required"
is an array of one or more {"name", "arguments"} calls (one when parallel_tool_calls is false),
each item a call of one of the tools with arguments of that tool's schema. `"auto"` on a chat
template that teaches Hermes' format is a grammar: any text, in which each <tool_call> block the
model opens must be a call of one of the tools with arguments of its schema, as the template
writes one (none or one block when parallel_tool_calls is false). The text is left free until the
model writes the block's opening tag (llguidance's lazy lexemes); then the block is held whole.
"""

import json

from .errors import ApiError
from .protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    Sampling,
    StructuredOutputs,
    Tool,
)

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def constraint(body: Sampling, tool_format: str = "") -> dict:
    """The SDK keyword of the request's one constraint ({}: none); a 400 when two parameters
    would each constrain the output. `tool_format`: the tool-call format the model's chat template
    teaches ("hermes"), which `"auto"` holds calls to where nothing else constrains the output."""
    given = {}
    if body.response_format is not None and body.response_format.type != "text":
        given["response_format"] = of_response_format(body.response_format)
    if body.structured_outputs is not None:
        given["structured_outputs"] = of_structured_outputs(body.structured_outputs)
    if isinstance(body, ChatCompletionRequest) and body.tool_mode not in ("none", "auto"):
        given["tool_choice"] = of_tool_choice(body)
    if len(given) > 1:
        names = " and ".join(f"`{name}`" for name in given)
        raise ApiError(400, f"{names} each constrain the output; give one of them", next(iter(given)))
    hermes = tool_format == "hermes"  # the one format the gateway reads calls in (tool_calls.py)
    if not given and isinstance(body, ChatCompletionRequest) and body.tool_mode == "auto" and hermes:
        return of_auto_tools(body.tools, body.parallel_tool_calls)
    return next(iter(given.values()), {})


def of_tool_choice(body: ChatCompletionRequest) -> dict:
    mode = body.tool_mode
    if isinstance(mode, NamedToolChoice):
        return of_named_tool(next(t for t in body.tools if t.function.name == mode.function.name))
    return of_required_tools(body.tools, body.parallel_tool_calls)


def of_response_format(response_format: ResponseFormat) -> dict:
    """A json_object or json_schema format (type text constrains nothing: constraint())."""
    if response_format.type == "json_object":
        return {"json_object": True}
    return {"json_schema": response_format.json_schema.schema_}


def of_structured_outputs(structured: StructuredOutputs) -> dict:
    name, value = next((n, v) for n, v in structured.fields_given().items() if v)
    return {"json_schema" if name == "json" else name: value}


def of_named_tool(tool: Tool) -> dict:
    return {"json_schema": _arguments(tool)}


def of_required_tools(tools: list[Tool], parallel: bool) -> dict:
    calls = [_call(tool) for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {"json_schema": schema}


def of_auto_tools(tools: list[Tool], parallel: bool) -> dict:
    """Hermes' blocks, <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>, among free text."""
    functions = " | ".join(f"function_{i}" for i in range(len(tools)))
    lines = [
        "%llguidance {}",
        "start: call* TEXT" if parallel else "start: TEXT | call SPACE",  # nothing but space after one
        r"TEXT: /(.|\n)*/",
        r"SPACE: /\s*/",
        'opening[lazy]: TEXT "<tool_call>"',
        rf'call: opening "\n{{\"name\": " ({functions}) "}}\n</tool_call>"',
    ]
    for i, tool in enumerate(tools):
        head = json.dumps(f"{json.dumps(tool.function.name)}, " + '"arguments": ')
        schema = json.dumps(_compact(_arguments(tool)), separators=(",", ":"))
        lines.append(f"function_{i}: {head} %json {schema}")
    return {"grammar": "\n".join(lines) + "\n"}


# Keywords that say what a value means and constrain nothing: left out of the schemas the tools'
# constraints carry (auto's grammar holds every tool's), which count toward a constraint's 64 KiB.
ANNOTATIONS = {
    "title",
    "description",
    "examples",
    "default",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
}
# Where schemas hold subschemas: maps of them, lists of them (items' old list form too), one of them.
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems", "items"}
SCHEMA_ONE = {
    "items",
    "additionalProperties",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
}


def _bare(schema: object) -> object:
    """The schema without its annotations, at every level; every other keyword as it was."""
    if not isinstance(schema, dict):
        return schema  # true, false, or what the grammar engine will refuse
    bare = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _bare(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            value = [_bare(sub) for sub in value]
        elif key in SCHEMA_ONE:
            value = _bare(value)
        bare[key] = value
    return bare


def _compact(schema: dict) -> dict:
    """The schema, its JSON written without free whitespace runs, as the other constraints'."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}


def _call(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _arguments(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _arguments(tool: Tool) -> dict:
    """The function's parameter schema without its annotations; none: it takes no arguments
    (OpenAI's reading)."""
    parameters = tool.function.parameters
    return NO_ARGUMENTS if parameters is None else _bare(parameters)
