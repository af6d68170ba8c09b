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
Templates that teach Qwen3-Coder's and GLM-4.5's formats have the same blocks, a call's name and
each parameter written in tags instead of JSON (ParameterTags): the parameters in their schema's
order, the required ones always, each value held to its schema.
On a template that teaches Llama 3's JSON calls it is a grammar too: a reply that opens with `{`
is one or more {"name", "parameters"} calls of the tools, separated by `;` (one when
parallel_tool_calls is false), and nothing after them; any other reply is free text. On a
template that teaches Mistral's calls: free text, then, if the model writes the special token that
opens calls ([TOOL_CALLS], by its id), a JSON array of {"name", "arguments"} calls of the tools (one
when parallel_tool_calls is false), and nothing after it.

A constraint's text is bounded (MAX_STRUCTURED_CHARS). The tools' schemas go in without their
annotations; where they still do not fit, the schemas of tools not marked `strict` are left out,
the largest first, until they do: such a tool's calls are held to arguments that are a JSON object
(OpenAI holds calls to the schema only under `strict`). Strict tools whose schemas do not fit
together are a 400.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shared.structured_limit import MAX_STRUCTURED_CHARS

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
ANY_ARGUMENTS = {"type": "object"}  # a tool's schema left out to fit: its arguments, any JSON object

log = logging.getLogger(__name__)


def constraint(body: Sampling, tool_format: str = "", call_token: int | None = None) -> dict:
    """The SDK keyword of the request's one constraint ({}: none); a 400 when two parameters
    would each constrain the output. `tool_format`: the tool-call format the model's chat template
    teaches ("hermes"), which `"auto"` holds calls to where nothing else constrains the output;
    `call_token`: the special token that opens calls, in formats that have one (mistral)."""
    given = _constraining(body)
    if len(given) > 1:
        names = " and ".join(f"`{name}`" for name in given)
        raise ApiError(400, f"{names} each constrain the output; give one of them", given[0])
    if given:
        return OF_PARAMETER[given[0]](body)
    known = tool_format in AUTO_GRAMMARS  # a format the gateway reads calls in (tool_calls.py)
    if isinstance(body, ChatCompletionRequest) and body.tool_mode == "auto" and known:
        return of_auto_tools(body.tools, body.parallel_tool_calls, tool_format, call_token)
    return {}


def constrains_from_the_start(body: Sampling) -> bool:
    """Whether the request's own parameters hold its output from the first token (a response
    format, structured outputs, or a forced tool choice), leaving a thinking model no room for
    its reasoning block; `"auto"`'s grammar leaves the text before a call free."""
    return bool(_constraining(body))


def _constraining(body: Sampling) -> list[str]:
    """The request's parameters that constrain its output, in OpenAI's order of them."""
    named = []
    if body.response_format is not None and body.response_format.type != "text":
        named.append("response_format")
    if body.structured_outputs is not None:
        named.append("structured_outputs")
    if isinstance(body, ChatCompletionRequest) and body.tool_mode not in ("none", "auto"):
        named.append("tool_choice")
    return named


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
    return _fitted([tool], lambda arguments: {"json_schema": arguments[0]})


def of_required_tools(tools: list[Tool], parallel: bool) -> dict:
    return _fitted(tools, lambda arguments: _required_calls(tools, arguments, parallel))


def of_auto_tools(tools: list[Tool], parallel: bool, tool_format: str, call_token: int | None = None) -> dict:
    grammar = AUTO_GRAMMARS[tool_format]
    return _fitted(tools, lambda arguments: grammar(tools, arguments, parallel, call_token))


def _required_calls(tools: list[Tool], arguments: list[dict], parallel: bool) -> dict:
    calls = [_call(tool, schema) for tool, schema in zip(tools, arguments, strict=True)]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {"json_schema": schema}


def _hermes_grammar(tools: list[Tool], arguments: list[dict], parallel: bool, call_token: None) -> dict:
    """Hermes' blocks, <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>, among free text
    (opened by text: no call token)."""
    call = rf'call: opening "\n{{\"name\": " ({_functions(tools)}) "}}\n</tool_call>"'
    return _lark([*_blocks_among_text(parallel), call, *_function_rules(tools, arguments, "arguments")])


def _llama3_json_grammar(tools: list[Tool], arguments: list[dict], parallel: bool, call_token: None) -> dict:
    """Llama 3's calls, {"name": ..., "parameters": ...} objects separated by `;`, the whole reply,
    or free text that does not open with `{` (no call token)."""
    lines = [
        "%llguidance {}",
        f"start: TEXT | SPACE {'call (SEPARATOR call)*' if parallel else 'call'}",  # then the reply ends
        r"TEXT: /\s*([^{\s](.|\n)*)?/",
        r"SPACE: /\s*/",
        r"SEPARATOR: /\s*;\s*/",
        rf'call: "{{\"name\": " ({_functions(tools)}) "}}"',
    ]
    return _lark(lines + _function_rules(tools, arguments, "parameters"))


def _mistral_grammar(tools: list[Tool], arguments: list[dict], parallel: bool, call_token: int) -> dict:
    """Free text, then maybe the call token and a JSON array of {"name": ..., "arguments": ...}
    calls (each may carry the nine-character "id" Mistral's templates write after the arguments),
    which ends the reply."""
    calls = '(call ", ")* call' if parallel else "call"
    lines = [
        "%llguidance {}",
        f'start: TEXT (<[{call_token}]> SPACE "[" {calls} "]")?',  # the reply ends with the array
        r"TEXT: /(.|\n)*/",
        r"SPACE: / ?/",
        r'ID: /, "id": "[A-Za-z0-9]{9}"/',
        rf'call: "{{\"name\": " ({_functions(tools)}) ID? "}}"',
    ]
    return _lark(lines + _function_rules(tools, arguments, "arguments"))


@dataclass(frozen=True)
class ParameterTags:
    """How a format of <tool_call> blocks writes a call in tags: the block after its opening tag
    (`call_rule`, of the `functions` rule), a function's name, each parameter's key, and the end of
    its value. A key may not hold `unwritable` (its tag would not read back)."""

    call_rule: str
    function: str  # of {name}
    parameter: str  # of {key}
    value_end: str
    unwritable: str

    def writes(self, key: str) -> bool:
        return bool(key) and not any(c in key for c in self.unwritable)

    @property
    def unwritable_in_keys(self) -> str:
        """`unwritable` as a Lark regex class holds it."""
        return self.unwritable.replace("\n", "\\n")


XML_TAGS = ParameterTags(
    call_rule=r'call: opening "\n" ({functions}) "</function>\n</tool_call>"',
    function="<function={name}>\n",
    parameter="<parameter={key}>\n",
    value_end="\n</parameter>\n",
    unwritable=">\n",
)
GLM_TAGS = ParameterTags(
    call_rule='call: opening ({functions}) "</tool_call>"',
    function="{name}\n",
    parameter="<arg_key>{key}</arg_key>\n<arg_value>",
    value_end="</arg_value>\n",
    unwritable="<\n",
)


def _xml_grammar(tools: list[Tool], arguments: list[dict], parallel: bool, call_token: None) -> dict:
    """Qwen3-Coder's blocks among free text, as Hermes' are: <tool_call>\\n<function=NAME>\\n, then
    each parameter <parameter=KEY>\\nVALUE\\n</parameter>\\n in its schema's order (the required
    ones always), then </function>\\n</tool_call> (no call token)."""
    return _tagged_grammar(XML_TAGS, tools, arguments, parallel)


def _glm_grammar(tools: list[Tool], arguments: list[dict], parallel: bool, call_token: None) -> dict:
    """GLM-4.5's blocks among free text: <tool_call>NAME\\n, then each parameter
    <arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n in its schema's order (the required
    ones always), then </tool_call> (no call token)."""
    return _tagged_grammar(GLM_TAGS, tools, arguments, parallel)


def _tagged_grammar(tags: ParameterTags, tools: list[Tool], arguments: list[dict], parallel: bool) -> dict:
    """Blocks among free text whose calls write each parameter in tags. A string's value is any text
    (one of its enum, where it has one), a boolean's true or false, any other value JSON of its
    schema."""
    key_head, key_tail = tags.parameter.split("{key}")
    lines = [
        *_blocks_among_text(parallel),
        tags.call_rule.format(functions=_functions(tools)),
        rf"KEY: /[^{tags.unwritable_in_keys}]+/",
        f"text_value[lazy]: TEXT {json.dumps(tags.value_end)}",
        f"any_parameter: {json.dumps(key_head)} KEY {json.dumps(key_tail)} text_value",
    ]
    for i, (tool, schema) in enumerate(zip(tools, arguments, strict=True)):
        lines += _tagged_function_rules(tags, i, tool.function.name, schema)
    return _lark(lines)


def _blocks_among_text(parallel: bool) -> list[str]:
    """The rules of calls in <tool_call> blocks among free text, each block left free until the
    model writes its opening tag; the format's `call` rule says what the block holds."""
    return [
        "%llguidance {}",
        "start: call* TEXT" if parallel else "start: TEXT | call SPACE",  # nothing but space after one
        r"TEXT: /(.|\n)*/",
        r"SPACE: /\s*/",
        'opening[lazy]: TEXT "<tool_call>"',
    ]


def _lark(lines: list[str]) -> dict:
    return {"grammar": "\n".join(lines) + "\n"}


def _tagged_function_rules(tags: ParameterTags, i: int, name: str, schema: dict) -> list[str]:
    """function_i: tool i's name and parameters; any parameters, each a text, where its schema is
    not an object of named properties that the tags can hold one by one."""
    opening = json.dumps(tags.function.format(name=name))  # a Lark string is a JSON string
    properties, required = schema.get("properties"), schema.get("required", [])
    if not _tags_hold(tags, properties, required) or TAGS_UNHELD & schema.keys():
        return [f"function_{i}: {opening} any_parameter*"]
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}  # what $refs name
    rules, parts = [], []
    for j, (key, sub) in enumerate(properties.items()):
        rule, tag = f"parameter_{i}_{j}", json.dumps(tags.parameter.format(key=key))
        parts.append(rule if key in required else f"{rule}?")
        rules.append(f"{rule}: {tag} {_tagged_value(tags, sub, defs)}")
    return [f"function_{i}: {opening} {' '.join(parts)}", *rules]


def _tags_hold(tags: ParameterTags, properties: object, required: object) -> bool:
    """Whether the tags can hold these properties one by one: named properties, each name one tag
    can carry, and a list of the required names. (A property's schema that is not one is the
    grammar engine's to refuse.)"""
    writable = isinstance(properties, dict) and all(map(tags.writes, properties))
    return writable and isinstance(required, list)


def _tagged_value(tags: ParameterTags, schema: object, defs: dict) -> str:
    """The grammar of a parameter's value and the tag that closes it."""
    end = json.dumps(tags.value_end)
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    enum = schema.get("enum") if kinds == ["string"] else None
    if isinstance(enum, list) and all(isinstance(v, str) for v in enum):
        return f"({' | '.join(json.dumps(v) for v in enum)}) {end}"
    if "string" in kinds:
        return "text_value"  # the parser reads it as text (or null, where the schema allows it)
    if kinds == ["boolean"]:
        return f'("true" | "false" | "True" | "False") {end}'  # Python's too, as Qwen3-Coder's writes them
    held = {**schema, **defs} if isinstance(schema, dict) else schema
    return f"%json {_json(_compact(held) if isinstance(held, dict) else held)} {end}"


def _functions(tools: list[Tool]) -> str:
    return " | ".join(f"function_{i}" for i in range(len(tools)))


def _function_rules(tools: list[Tool], arguments: list[dict], key: str) -> list[str]:
    """function_i: the rest of a call of tool i after `{"name": `: its name, then `key`'s value of
    its schema."""
    rules = []
    for i, (tool, schema) in enumerate(zip(tools, arguments, strict=True)):
        head = json.dumps(f"{json.dumps(tool.function.name)}, " + f'"{key}": ')
        rules.append(f"function_{i}: {head} %json {_json(_compact(schema))}")
    return rules


# The SDK keyword each constraining parameter of a request asks for (_constraining).
OF_PARAMETER: dict[str, Callable[[Sampling], dict]] = {
    "response_format": lambda body: of_response_format(body.response_format),
    "structured_outputs": lambda body: of_structured_outputs(body.structured_outputs),
    "tool_choice": of_tool_choice,
}
# The grammar `"auto"` holds calls to, for each tool-call format a chat template may teach.
AUTO_GRAMMARS = {
    "hermes": _hermes_grammar,
    "llama3_json": _llama3_json_grammar,
    "mistral": _mistral_grammar,
    "qwen3_xml": _xml_grammar,
    "glm45": _glm_grammar,
}
# Keywords of an object schema that parameters in tags, each held one by one, cannot hold (its
# calls are then held to any parameters).
TAGS_UNHELD = {
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "$ref",
    "patternProperties",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "minProperties",
    "maxProperties",
}


def _fitted(tools: list[Tool], build: Callable[[list[dict]], dict]) -> dict:
    """build(the tools' argument schemas), the constraint they make; where its text is past the
    bound, with the schemas of tools not marked strict left out, the largest first, until it fits.
    Each schema is written once in the text, so leaving one out shortens it by about the schemas'
    difference: the constraint is built again only once that says it fits."""
    arguments = [_arguments(tool) for tool in tools]
    fitted = build(arguments)
    loose = [i for i, tool in enumerate(tools) if not tool.function.strict]
    loose.sort(key=lambda i: len(_json(arguments[i])), reverse=True)
    left_out = []
    while (excess := _length(fitted) - MAX_STRUCTURED_CHARS) > 0 and loose:
        while excess > 0 and loose:
            i = loose.pop(0)
            excess -= len(_json(arguments[i])) - len(_json(ANY_ARGUMENTS))
            arguments[i] = ANY_ARGUMENTS
            left_out.append(tools[i].function.name)
        fitted = build(arguments)
    if excess > 0:
        raise ApiError(
            400,
            f"The strict tools' parameter schemas do not fit in one constraint: with the other tools' "
            f"arguments held only to a JSON object, it takes {_length(fitted)} characters, past the "
            f"{MAX_STRUCTURED_CHARS} a constraint may hold. Mark fewer tools strict, or shorten their "
            "schemas.",
            "tools",
        )
    if left_out:
        log.warning(
            "%d tools' schemas left out of the calls' constraint to fit it: %s", len(left_out), left_out
        )
    return fitted


def _length(sent: dict) -> int:
    """The characters of a constraint's text, as the worker counts them (the SDK writes a schema
    compact)."""
    [value] = sent.values()
    return len(value) if isinstance(value, str) else len(_json(value))


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# Keywords that say what a value means and constrain nothing: left out of the schemas the tools'
# constraints carry (auto's grammar holds every tool's), which count toward MAX_STRUCTURED_CHARS.
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


def _call(tool: Tool, arguments: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _arguments(tool: Tool) -> dict:
    """The function's parameter schema without its annotations; none: it takes no arguments
    (OpenAI's reading)."""
    parameters = tool.function.parameters
    return NO_ARGUMENTS if parameters is None else _bare(parameters)
