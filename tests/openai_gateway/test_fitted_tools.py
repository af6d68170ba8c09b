"""Tools whose schemas do not fit one constraint (MAX_STRUCTURED_CHARS, the worker's bound): the
schemas of tools not marked strict are left out, the largest first, until they fit, and those
tools' calls are held to arguments that are any JSON object; strict tools keep theirs, and strict
tools that do not fit together are a 400 naming `tools`. Checked with the worker's own grammar
engine (auto's grammar) and jsonschema (required's array), under every tool choice."""

import functools
import json
import logging

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from inference_service.engine.grammars import Grammars
from inference_service.sampling import Structured
from openai_gateway.constraints import ANY_ARGUMENTS, constraint
from openai_gateway.errors import ApiError
from openai_gateway.protocol import ChatCompletionRequest
from shared.structured_limit import MAX_STRUCTURED_CHARS

ARGUMENTS = [f"argument_{i}" for i in range(10)]
PARAMETERS = {
    "type": "object",
    "properties": {name: {"type": "string"} for name in ARGUMENTS},
    "required": ARGUMENTS,
}
WHOLE = {name: "x" for name in ARGUMENTS}


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# What leaving one tool's schema out saves, as the constraints write schemas (compact).
SAVED = len(compact(PARAMETERS)) - len(compact(ANY_ARGUMENTS))


def tools(count: int = 128, strict: range = range(0)) -> list[dict]:
    """`count` tools (OpenAI's most is 128) of 10 required string arguments: 128 of them take more
    than a constraint holds."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "parameters": PARAMETERS,
                **({"strict": True} if k in strict else {}),
            },
        }
        for k in range(count)
    ]


def sent(tool_list: list[dict], choice: object = "auto") -> dict:
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "?"}], tools=tool_list, tool_choice=choice
    )
    return constraint(body, tool_format="hermes")


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {compact(arguments)}}}\n</tool_call>'


def takes(grammars: Grammars, text_tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    m = grammars.matcher(Structured("grammar", grammar))
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


def test_whole_tools_past_the_bound_still_need_leaving_out():
    """The premise: with every schema, 128 such tools take more than a constraint holds."""
    tool_list = tools()
    for tool in tool_list:
        tool["function"]["strict"] = True
    with pytest.raises(ApiError) as raised:
        sent(tool_list)
    assert raised.value.status == 400 and raised.value.param == "tools"
    assert f"past the {MAX_STRUCTURED_CHARS}" in raised.value.message and "strict" in raised.value.message


def test_auto_keeps_as_many_schemas_as_fit(grammars, text_tokenizer, caplog):
    """Ties are left out in the tools' order; one schema fewer left out would not fit; the calls
    of tools kept follow their schema, those of tools left out take any object, and nothing else."""
    with caplog.at_level(logging.WARNING, logger="openai_gateway.constraints"):
        grammar = sent(tools())["grammar"]
    [record] = caplog.records
    assert len(grammar) <= MAX_STRUCTURED_CHARS < len(grammar) + SAVED
    left_out = int(record.getMessage().split()[0])
    assert left_out == 23 and f"'tool_{left_out - 1}'" in record.getMessage()  # README: 105 kept
    assert f"'tool_{left_out}'" not in record.getMessage()
    kept, loose = f"tool_{left_out}", f"tool_{left_out - 1}"
    held = functools.partial(takes, grammars, text_tokenizer, grammar)
    assert held(call(kept, WHOLE))
    assert not held(call(kept, {"argument_0": "x"}))  # the others are required
    assert held(call(loose, {"argument_0": "x"}))
    assert held(call(loose, {"anything": [1, {"at": "all"}]}))
    assert not held(call(loose, [1]))  # arguments are an object
    assert not held(call("tool_128", WHOLE))  # no such tool


def test_the_largest_schema_is_left_out_first(caplog):
    """One tool past the bound alone, last among small ones: it alone is left out."""
    huge = {"type": "object", "properties": {f"a{i}": {"type": "integer"} for i in range(6000)}}
    tool_list = [*tools(count=16), {"type": "function", "function": {"name": "huge", "parameters": huge}}]
    with caplog.at_level(logging.WARNING, logger="openai_gateway.constraints"):
        grammar = sent(tool_list)["grammar"]
    assert grammar.count(compact(PARAMETERS)[:-1]) == 16
    assert "%json " + compact(ANY_ARGUMENTS)[:-1] in grammar
    assert [record.getMessage() for record in caplog.records] == [
        "1 tools' schemas left out of the calls' constraint to fit it: ['huge']"
    ]


def test_strict_tools_keep_their_schemas(grammars, text_tokenizer):
    grammar = sent(tools(strict=range(10)))["grammar"]
    assert len(grammar) <= MAX_STRUCTURED_CHARS
    for k in range(10):  # would be the first left out if they were not strict
        assert not takes(grammars, text_tokenizer, grammar, call(f"tool_{k}", {"argument_0": "x"}))
    assert takes(grammars, text_tokenizer, grammar, call("tool_10", {"argument_0": "x"}))


def test_required_keeps_as_many_schemas_as_fit():
    schema = sent(tools(), "required")["json_schema"]
    text = compact(schema)
    assert len(text) <= MAX_STRUCTURED_CHARS < len(text) + SAVED
    kept = [item for item in schema["items"]["anyOf"] if item["properties"]["arguments"] == PARAMETERS]
    assert 0 < len(kept) < 128
    first_kept = kept[0]["properties"]["name"]["const"]
    jsonschema.validate([{"name": first_kept, "arguments": WHOLE}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": first_kept, "arguments": {"argument_0": "x"}}], schema)
    jsonschema.validate([{"name": "tool_0", "arguments": {"anything": 1}}], schema)


def test_a_named_tool_too_large_is_held_to_an_object_unless_strict():
    parameters = {"type": "object", "properties": {f"a{i}": {"type": "integer"} for i in range(6000)}}
    tool = {"type": "function", "function": {"name": "huge", "parameters": parameters}}
    named = {"type": "function", "function": {"name": "huge"}}
    assert sent([tool], named) == {"json_schema": ANY_ARGUMENTS}
    tool["function"]["strict"] = True
    with pytest.raises(ApiError) as raised:
        sent([tool], named)
    assert raised.value.status == 400 and raised.value.param == "tools"


def test_tools_that_fit_are_held_whole(caplog):
    with caplog.at_level(logging.WARNING, logger="openai_gateway.constraints"):
        grammar = sent(tools(count=16))["grammar"]
    assert grammar.count(compact(PARAMETERS)[:-1]) == 16
    assert not caplog.records


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1200), st.booleans()), min_size=1, max_size=128),
    st.sampled_from(["auto", "required"]),
)
def test_any_tool_list_fits_or_is_refused_for_its_strict_tools(shapes, choice):
    """Tools of `properties` arguments each, some strict: the constraint sent fits; strict tools
    and tools whose schemas all fit keep them whole; a 400 only where the strict tools' schemas do
    not fit with every other tool's left out."""
    tool_list = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "parameters": {
                    "type": "object",
                    "properties": {f"a{i}": {"type": "integer"} for i in range(size)},
                },
                "strict": strict,
            },
        }
        for k, (size, strict) in enumerate(shapes)
    ]
    whole = [tool["function"]["parameters"] for tool in tool_list]
    least = [p if strict else ANY_ARGUMENTS for p, (_, strict) in zip(whole, shapes, strict=True)]
    try:
        constraint_sent = sent(tool_list, choice)
    except ApiError as e:
        assert e.status == 400 and e.param == "tools"
        assert not _fits(_with_parameters(tool_list, least), choice)  # nothing more to leave out
        return
    [text] = constraint_sent.values()
    assert len(_text(text)) <= MAX_STRUCTURED_CHARS
    kept = [held == p for held, p in zip(_schemas_sent(constraint_sent), whole, strict=True)]
    assert all(k for k, (_, strict) in zip(kept, shapes, strict=True) if strict)
    if _fits(_with_parameters(tool_list, whole, strict=True), choice):
        assert all(kept)  # all fit: none left out


def _fits(tool_list: list[dict], choice: str) -> bool:
    try:
        sent(tool_list, choice)
    except ApiError:
        return False
    return True


def _schemas_sent(constraint_sent: dict) -> list[dict]:
    """Each tool's arguments schema as the constraint holds it (auto's grammar: after `%json`,
    without the whitespace setting; required's array: each call's `arguments`)."""
    if "grammar" in constraint_sent:
        lines = [
            line.split(" %json ", 1)[1]
            for line in constraint_sent["grammar"].splitlines()
            if " %json " in line
        ]
        return [{k: v for k, v in json.loads(line).items() if k != "x-guidance"} for line in lines]
    items = constraint_sent["json_schema"]["items"]
    return [call["properties"]["arguments"] for call in items.get("anyOf", [items])]


def _text(value: object) -> str:
    return value if isinstance(value, str) else compact(value)


def _with_parameters(tool_list: list[dict], parameters: list[dict], strict: bool = False) -> list[dict]:
    """The tools with these parameter schemas, every one strict when `strict`, else as they were."""
    return [
        {**tool, "function": {**tool["function"], "parameters": p} | ({"strict": True} if strict else {})}
        for tool, p in zip(tool_list, parameters, strict=True)
    ]
