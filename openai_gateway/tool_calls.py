"""Tool calls read from a completion's text, whole or as it streams, in the ways a chat request
can ask for them:

- NamedCall: `tool_choice` names a function; the output is constrained to its arguments' JSON, so
  the whole text is the arguments, streamed as it comes.
- CallList: `tool_choice: "required"`; the output is constrained to a JSON array of
  {"name", "arguments"} objects, each call sent once it is whole.
- HermesCalls: `tool_choice: "auto"` on a chat template that teaches Hermes' format; the model
  writes text and <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, as Hermes,
  Qwen2.5 and Qwen3 do. Text outside the blocks is content; text that may be the start of a tag
  is held back until it is known not to be; a block whose JSON is not a call stays content.
- JsonReplyCalls: `tool_choice: "auto"` on a chat template that teaches Llama 3's JSON format (3.1
  to 3.3, for the tools a user gives); a reply that opens with `{` is calls, {"name": ...,
  "parameters": {...}} objects separated by `;` (as vLLM reads them), sent once the reply is whole;
  any other reply is content, streamed as it comes. A reply that opens with `{` but is not calls is
  content, sent at its end.
- XmlCalls: `tool_choice: "auto"` on a chat template that teaches Qwen3-Coder's format: blocks as
  Hermes', each <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>;
  a value is read by the tool's schema (text where it says string, else JSON).
- GlmCalls: `tool_choice: "auto"` on a chat template that teaches GLM-4.5's format: blocks as
  Hermes', each <tool_call>NAME, then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> for each
  argument, </tool_call>; a value is read by the tool's schema, as XmlCalls' are.
- MistralCalls: `tool_choice: "auto"` on a chat template that teaches Mistral's format; text is
  content until the special token [TOOL_CALLS] (the worker keeps it in the text), and after it the
  reply is a JSON array of {"name", "arguments"} calls, sent once the reply is whole. An array that
  is not calls is content, the token's text with it.

Each parser takes the text in pieces (feed) and is told when it ends (end); both return the
content and the parts of calls to send, as OpenAI streams them: a call's first part carries its id
and name, later parts more of its arguments.
"""

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ApiError
from .protocol import NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
# Qwen3-Coder's block: <function=NAME> and its parameters, each <parameter=KEY>\nVALUE\n</parameter>.
XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
XML_PARAMETER, XML_PARAMETER_END = "<parameter=", "</parameter>"
# GLM-4.5's block: the name, then each argument <arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>.
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
WHITESPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class CallPart:
    index: int  # of the call among the choice's calls
    arguments: str  # more of its arguments' JSON text
    id: str | None = None  # the first part's alone
    name: str | None = None

    def body(self) -> dict:
        """The part as a stream chunk's `tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallPart] = field(default_factory=list)

    def __add__(self, other: "Parsed") -> "Parsed":
        return Parsed(self.content + other.content, self.calls + other.calls)


def parser_for(
    mode: str | NamedToolChoice, template_format: str, schemas: dict[str, dict]
) -> Callable[[], "ToolCallParser"] | None:
    """What reads a choice's calls for this tool choice (None: tools are not called); `auto` needs
    a chat template that teaches the model a format to write calls in. `schemas`: each tool's
    parameter schema, by name (XML calls' values are read by them)."""
    if mode == "none":
        return None
    if isinstance(mode, NamedToolChoice):
        return lambda: NamedCall(mode.function.name)
    if mode == "required":
        return CallList
    if template_format not in AUTO_PARSERS:
        raise ApiError(
            400,
            "This model's chat template teaches it no tool-call format, so calls cannot be read from "
            'its text (`tool_choice: "auto"`, the default with `tools`); ask for `"required"` or a '
            'named function, which constrain the output to calls, or `"none"`.',
            "tool_choice",
        )
    parser = AUTO_PARSERS[template_format]
    return (lambda: parser(schemas)) if issubclass(parser, XmlCalls) else parser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_calls(parts: list[CallPart]) -> list[dict]:
    """A completion's calls, each part joined into one, as a whole message's `tool_calls`."""
    calls: dict[int, dict] = {}
    for part in parts:
        if part.id is not None:
            function = {"name": part.name, "arguments": ""}
            calls[part.index] = {"id": part.id, "type": "function", "function": function}
        calls[part.index]["function"]["arguments"] += part.arguments
    return [calls[i] for i in sorted(calls)]


class ToolCallParser(ABC):
    def __init__(self):
        self.calls = 0  # calls found so far

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """What the next piece of the text adds."""

    def end(self) -> Parsed:
        """What was held back, once the text is whole."""
        return Parsed()

    def _call(self, name: str, arguments: str) -> CallPart:
        part = CallPart(self.calls, arguments, call_id(), name)
        self.calls += 1
        return part


class NamedCall(ToolCallParser):
    def __init__(self, name: str):
        super().__init__()
        self._name = name

    def feed(self, text: str) -> Parsed:
        if self.calls == 0:
            return Parsed(calls=[self._call(self._name, text)])
        return Parsed(calls=[CallPart(0, text)]) if text else Parsed()

    def end(self) -> Parsed:
        return self.feed("") if self.calls == 0 else Parsed()


class CallList(ToolCallParser):
    """Reads the array's objects as they close: the grammar wrote it, so it is JSON, but the
    scanner still tracks strings, in which braces do not count."""

    def __init__(self):
        super().__init__()
        self._text = ""
        self._scanned = self._depth = 0
        self._in_string = self._escaped = False
        self._start = -1

    def feed(self, text: str) -> Parsed:
        self._text += text
        parsed = Parsed()
        for i in range(self._scanned, len(self._text)):
            item = self._scan(i)
            if item is not None:
                call = json.loads(item)
                parsed.calls.append(self._call(call["name"], _compact(call["arguments"])))
        self._scanned = len(self._text)
        return parsed

    def _scan(self, i: int) -> str | None:
        """Advances over character i; the text of an array item that it closes, if it does."""
        char = self._text[i]
        if self._in_string:
            self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            return None
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
            if self._depth == 2:
                self._start = i
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1:
                return self._text[self._start : i + 1]
        return None


class HermesCalls(ToolCallParser):
    def __init__(self):
        super().__init__()
        self._held = ""  # text not yet sent: a possible tag's start, or a block not yet closed
        self._searched = 0  # no tag starts in held before this: a block is searched once, not per piece
        self._in_block = False

    def feed(self, text: str) -> Parsed:
        self._held += text
        parsed = Parsed()
        while True:
            tag = CLOSE if self._in_block else OPEN
            at = self._held.find(tag, self._searched)
            if at < 0:
                self._searched = max(0, len(self._held) - len(tag) + 1)
                break
            before, self._held, self._searched = self._held[:at], self._held[at + len(tag) :], 0
            parsed += self._block(before) if self._in_block else self._content(before)
            self._in_block = not self._in_block
        if not self._in_block:
            keep = tag_start(self._held, OPEN)
            parsed += self._content(self._held[: len(self._held) - keep])
            self._held, self._searched = self._held[len(self._held) - keep :], 0
        return parsed

    def end(self) -> Parsed:
        held, self._held = self._held, ""
        return self._block(held, closed=False) if self._in_block else self._content(held)

    def _block(self, inner: str, closed: bool = True) -> Parsed:
        """A call, or, when the block is not one, its text as content."""
        call = self._read(inner)
        if call is None:
            return self._content(OPEN + inner + (CLOSE if closed else ""))
        return Parsed(calls=[self._call(*call)])

    def _content(self, text: str) -> Parsed:
        """Text between and after calls that is only whitespace (the newlines templates write
        between blocks) is not content."""
        if self.calls and not text.strip():
            return Parsed()
        return Parsed(content=text)

    def _read(self, inner: str) -> tuple[str, str] | None:
        """(name, arguments' JSON) of the call a block holds; None where it holds none."""
        return _hermes_call(inner)


class XmlCalls(HermesCalls):
    def __init__(self, schemas: dict[str, dict]):
        super().__init__()
        self._schemas = schemas  # each tool's parameter schema, by name: how to read its values

    def _read(self, inner: str) -> tuple[str, str] | None:
        function = XML_FUNCTION.fullmatch(inner)
        if function is None:
            return None
        name, body = function[1], function[2]
        arguments = _xml_arguments(body, self._properties(name))
        return None if arguments is None else (name, _compact(arguments))

    def _properties(self, name: str) -> dict:
        """The named tool's parameters' schemas, by key ({} where it has none)."""
        schema = self._schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return properties if isinstance(properties, dict) else {}


class GlmCalls(XmlCalls):
    def _read(self, inner: str) -> tuple[str, str] | None:
        """The name runs to the line's end or the first key (GLM-4.7 writes no newline there)."""
        ends = [at for at in (inner.find("\n"), inner.find(GLM_KEY)) if at >= 0]
        cut = min(ends, default=len(inner))
        name = inner[:cut].strip()
        if not name:
            return None
        arguments = _glm_arguments(inner[cut:], self._properties(name))
        return None if arguments is None else (name, _compact(arguments))


class JsonReplyCalls(ToolCallParser):
    def __init__(self):
        super().__init__()
        self._held = ""  # the reply's opening whitespace, or a reply that opens with `{`
        self._is_calls: bool | None = None  # known once the reply shows its first other character

    def feed(self, text: str) -> Parsed:
        if self._is_calls is False:
            return Parsed(content=text)
        self._held += text
        if self._is_calls is None and (opening := text.lstrip()):  # what is held before it is space
            self._is_calls = opening.startswith("{")
            if not self._is_calls:
                held, self._held = self._held, ""
                return Parsed(content=held)
        return Parsed()

    def end(self) -> Parsed:
        held, self._held = self._held, ""
        calls = _json_calls(held) if self._is_calls else None
        if calls is None:
            return Parsed(content=held) if held else Parsed()
        return Parsed(calls=[self._call(*call) for call in calls])


class MistralCalls(ToolCallParser):
    def __init__(self):
        super().__init__()
        self._held = ""  # text not yet sent: a possible start of the token, or the calls after it
        self._in_calls = False

    def feed(self, text: str) -> Parsed:
        if self._in_calls:
            self._held += text
            return Parsed()
        searched = max(0, len(self._held) - len(MISTRAL_CALLS) + 1)  # held is a tag's start at most
        self._held += text
        at = self._held.find(MISTRAL_CALLS, searched)
        if at >= 0:
            before, self._held = self._held[:at], self._held[at + len(MISTRAL_CALLS) :]
            self._in_calls = True
            return Parsed(content=before) if before.strip() else Parsed()
        sent = len(self._held) - tag_start(self._held, MISTRAL_CALLS)
        content, self._held = self._held[:sent], self._held[sent:]
        return Parsed(content=content)

    def end(self) -> Parsed:
        held, self._held = self._held, ""
        calls = _array_calls(held) if self._in_calls else None
        if calls is not None:
            return Parsed(calls=[self._call(*call) for call in calls])
        text = MISTRAL_CALLS + held if self._in_calls else held
        return Parsed(content=text) if text else Parsed()


def _xml_arguments(body: str, properties: dict) -> dict | None:
    """The arguments a function's parameters are, <parameter=KEY>\\nVALUE\\n</parameter> one after
    another with only space around them; None where the body is anything else. Each search starts
    where the last ended: linear in the body, however a model writes it."""
    arguments, at = {}, 0
    while (start := body.find(XML_PARAMETER, at)) >= 0:
        named = body.find(">", start)
        end = body.find(XML_PARAMETER_END, named)
        key = body[start + len(XML_PARAMETER) : named]
        if body[at:start].strip() or named < 0 or end < 0 or not key or "\n" in key:
            return None
        value = body[named + 1 : end].removeprefix("\n").removesuffix("\n")
        arguments[key] = _xml_value(value, properties.get(key, {}))
        at = end + len(XML_PARAMETER_END)
    return None if body[at:].strip() else arguments


def _glm_arguments(body: str, properties: dict) -> dict | None:
    """The arguments <arg_key>KEY</arg_key> <arg_value>VALUE</arg_value> pairs are, one after
    another with only space around their tags; None where the body is anything else. Each search
    starts where the last ended: linear in the body, however a model writes it."""
    arguments, at = {}, 0
    while (start := body.find(GLM_KEY, at)) >= 0:
        if body[at:start].strip():
            return None
        key_end = body.find(GLM_KEY_END, start)
        value = body.find(GLM_VALUE, key_end) if key_end >= 0 else -1
        end = body.find(GLM_VALUE_END, value) if value >= 0 else -1
        if end < 0 or body[key_end + len(GLM_KEY_END) : value].strip():
            return None
        key = body[start + len(GLM_KEY) : key_end].strip()
        if not key:
            return None
        arguments[key] = _xml_value(body[value + len(GLM_VALUE) : end], properties.get(key, {}))
        at = end + len(GLM_VALUE_END)
    return None if body[at:].strip() else arguments


def _xml_value(text: str, schema: object) -> object:
    """A parameter's value as the tool's schema reads it: null where it may be null and says so;
    text where it says string; true or false (as JSON or as Python writes them, which
    Qwen3-Coder's template does) where it says boolean; JSON otherwise, or the text where it is
    not JSON."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "null" in kinds and text == "null":
        return None
    if "string" in kinds:
        return text
    if "boolean" in kinds and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _array_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls a JSON array of call objects is; None where the text is anything else."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # what a model writes may nest past Python's limit
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_of(item) for item in value]
    return None if None in calls else calls


def _json_calls(reply: str) -> list[tuple[str, str]] | None:
    """The calls a reply is, JSON objects separated by `;`; None where it is anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(reply, WHITESPACE.match(reply, at).end())
        except (ValueError, RecursionError):  # what a model writes may nest past Python's limit
            return None
        call = _call_of(value)
        if call is None:
            return None
        calls.append(call)
        at = WHITESPACE.match(reply, at).end()
        if at == len(reply):
            return calls
        if reply[at] != ";":
            return None
        at += 1


def _hermes_call(inner: str) -> tuple[str, str] | None:
    try:
        call = json.loads(inner)
    except (ValueError, RecursionError):  # what a model writes may nest past Python's limit
        return None
    return _call_of(call)


def _call_of(call: object) -> tuple[str, str] | None:
    """(name, arguments' JSON) of a call object the model wrote; None where it is none."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return call["name"], _compact(arguments)


def tag_start(text: str, tag: str) -> int:
    """How many of text's last characters may begin the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _compact(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


# The parser of `"auto"`'s calls for each tool-call format a chat template may teach
# (Tokenizer.tool_call_format).
AUTO_PARSERS = {
    "hermes": HermesCalls,
    "llama3_json": JsonReplyCalls,
    "mistral": MistralCalls,
    "qwen3_xml": XmlCalls,
    "glm45": GlmCalls,
}
