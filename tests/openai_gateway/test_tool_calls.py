"""Tool calls read from completion text (openai_gateway/tool_calls.py): whatever pieces a stream
brings the text in, the calls and content sent add up to what the whole text gives; Hermes blocks
become calls, text around them content, and what is not a call stays text; a Llama 3 reply that
is JSON calls becomes calls, any other reply content; after Mistral's [TOOL_CALLS] a JSON array of
calls becomes calls, the text before it content; Qwen3-Coder's XML blocks and GLM-4.5's blocks of
tags become calls, their values read by the tools' schemas."""

import functools
import itertools
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from openai_gateway.errors import ApiError
from openai_gateway.protocol import FunctionName, NamedToolChoice
from openai_gateway.tool_calls import (
    CallList,
    GlmCalls,
    HermesCalls,
    JsonReplyCalls,
    MistralCalls,
    NamedCall,
    Parsed,
    XmlCalls,
    parser_for,
    whole_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
HERMES = {
    "calls": (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"name": "time", "arguments": {"tz": "<tool_call>}"}}\n</tool_call>'
    ),
    "text only": "No tools needed: 1 < 2 and <b>bold</b>.",
    "bad json": "<tool_call>{not json}</tool_call> after",
    "unclosed": f"<tool_call>{WEATHER}",
    "unclosed bad": "so <tool_call>{half",
    "partial tag at end": "ends with <tool_",
    "nested past the recursion limit": "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
}

LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
NESTED = '{"name": "f", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
# A reply, the content it gives, and the calls (name, arguments).
LLAMA_REPLIES = {
    "one call": (LLAMA, "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    "two calls, space around": (
        f' \n{LLAMA}; {{"name": "time", "parameters": {{"tz": "; }}"}}}}\n',
        "",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("time", {"tz": "; }"})],
    ),
    "arguments, as some models write": ('{"name": "time", "arguments": {}}', "", [("time", {})]),
    "text": (" Paris is {sunny}.", " Paris is {sunny}.", []),
    "a JSON object not a call": ('{"city": "Paris"}', '{"city": "Paris"}', []),
    "a call, then text": (f"{LLAMA} is the call", f"{LLAMA} is the call", []),
    "calls, one unclosed": (f"{LLAMA}; {LLAMA[:-1]}", f"{LLAMA}; {LLAMA[:-1]}", []),
    "only space": ("  \n", "  \n", []),
    "nested past the recursion limit": (NESTED, NESTED, []),
}

MISTRAL = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'
# A reply (the worker keeps the call token in its text), the content it gives, and the calls.
MISTRAL_REPLIES = {
    "one call": (f"[TOOL_CALLS] {MISTRAL}", "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    "two calls, with the ids Mistral's templates write, text before": (
        'Checking.[TOOL_CALLS][{"name": "time", "arguments": {"tz": "]"}, "id": "a1b2c3d4e"}, '
        '{"name": "time", "arguments": {}}]',
        "Checking.",
        [("time", {"tz": "]"}), ("time", {})],
    ),
    "text": ("Paris is [sunny].", "Paris is [sunny].", []),
    "a token's start, not the token": ("see [TOOL_CALL", "see [TOOL_CALL", []),
    "an array not of calls": ("[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    "an empty array": ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    "a call, then text": (f"[TOOL_CALLS] {MISTRAL} done", f"[TOOL_CALLS] {MISTRAL} done", []),
    "unclosed": (f"[TOOL_CALLS] {MISTRAL[:-1]}", f"[TOOL_CALLS] {MISTRAL[:-1]}", []),
    "nested past the recursion limit": (
        "[TOOL_CALLS]" + "[" * 5000 + "]" * 5000,
        "[TOOL_CALLS]" + "[" * 5000 + "]" * 5000,
        [],
    ),
}

# The tools' parameter schemas XML values are read by.
XML_SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "hot": {"type": "boolean"},
            "stops": {"type": ["array", "null"]},
        },
    },
    "note": {"type": "object", "properties": {"text": {"type": ["string", "null"]}}},
}
XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
    "{more}</function>\n</tool_call>"
)
NOTE = "<tool_call>\n<function=note>\n<parameter=text>\nline one\n</parameter>\n</function>\n</tool_call>"
# A reply, the content it gives, and the calls (name, arguments).
XML_REPLIES = {
    "a call, text before it": (
        "Let me check.\n" + XML.format(city="Paris", more="<parameter=days>\n3\n</parameter>\n"),
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "values by their schema": (
        XML.format(
            city="12",  # a string, though it reads as JSON
            more='<parameter=hot>\nTrue\n</parameter>\n<parameter=stops>\n["Lyon"]\n</parameter>\n',
        )
        + "\n"
        + NOTE,
        "",
        [("get_weather", {"city": "12", "hot": True, "stops": ["Lyon"]}), ("note", {"text": "line one"})],
    ),
    "null where the schema allows it": (
        NOTE.replace("line one", "null"),
        "",
        [("note", {"text": None})],
    ),
    "a value that is not JSON, of an unknown tool": (
        "<tool_call>\n<function=other>\n<parameter=x>\nnot json\n</parameter>\n</function>\n</tool_call>",
        "",
        [("other", {"x": "not json"})],
    ),
    "text only": ("No <b>call</b> needed.", "No <b>call</b> needed.", []),
    "a block without a function": ("<tool_call>\nhi\n</tool_call>", "<tool_call>\nhi\n</tool_call>", []),
    "text between parameters": (
        XML.format(city="Rome", more="stray\n<parameter=days>\n3\n</parameter>\n"),
        XML.format(city="Rome", more="stray\n<parameter=days>\n3\n</parameter>\n"),
        [],
    ),
    "parameters never closed": (
        "<tool_call>\n<function=f>\n" + "<parameter=a>\nx\n" * 500 + "</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n" + "<parameter=a>\nx\n" * 500 + "</function>\n</tool_call>",
        [],
    ),
    "the last parameter unclosed": (
        XML.format(city="Rome", more="<parameter=days>\n3\n"),
        XML.format(city="Rome", more="<parameter=days>\n3\n"),
        [],
    ),
    "a parameter without a name": (
        XML.format(city="Rome", more="<parameter=>\n3\n</parameter>\n"),
        XML.format(city="Rome", more="<parameter=>\n3\n</parameter>\n"),
        [],
    ),
    "text after the parameters": (
        XML.format(city="Rome", more="stray\n"),
        XML.format(city="Rome", more="stray\n"),
        [],
    ),
}
GLM = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{city}</arg_value>\n{more}</tool_call>"
GLM_NOTE = "<tool_call>note\n<arg_key>text</arg_key>\n<arg_value>line one</arg_value>\n</tool_call>"
GLM_REPLIES = {
    "a call, text before it": (
        "Let me check.\n"
        + GLM.format(city="Paris", more="<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"),
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "values by their schema": (
        GLM.format(
            city=" 12\n",  # a string, though it reads as JSON: as written, space and all
            more='<arg_key>hot</arg_key><arg_value>true</arg_value><arg_key>stops</arg_key>\n<arg_value>["Lyon"]</arg_value>',
        )
        + "\n"
        + GLM_NOTE,
        "",
        [("get_weather", {"city": " 12\n", "hot": True, "stops": ["Lyon"]}), ("note", {"text": "line one"})],
    ),
    "GLM-4.7's name, no newline before the first key": (
        "<tool_call>note<arg_key>text</arg_key><arg_value>null</arg_value></tool_call>",
        "",
        [("note", {"text": None})],
    ),
    "a call without arguments": ("<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    "a value that is not JSON, of an unknown tool": (
        "<tool_call>other\n<arg_key>x</arg_key>\n<arg_value>not json</arg_value>\n</tool_call>",
        "",
        [("other", {"x": "not json"})],
    ),
    "a block without a name": ("<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    "text between arguments": (
        GLM.format(city="Rome", more="stray\n<arg_key>days</arg_key><arg_value>3</arg_value>"),
        GLM.format(city="Rome", more="stray\n<arg_key>days</arg_key><arg_value>3</arg_value>"),
        [],
    ),
    "text between a key and its value": (
        GLM.format(city="Rome", more="<arg_key>days</arg_key>, <arg_value>3</arg_value>"),
        GLM.format(city="Rome", more="<arg_key>days</arg_key>, <arg_value>3</arg_value>"),
        [],
    ),
    "keys never closed": (
        "<tool_call>f\n" + "<arg_key>a\n" * 500 + "</tool_call>",
        "<tool_call>f\n" + "<arg_key>a\n" * 500 + "</tool_call>",
        [],
    ),
    "a key without its value": (
        GLM.format(city="Rome", more="<arg_key>days</arg_key>\n"),
        GLM.format(city="Rome", more="<arg_key>days</arg_key>\n"),
        [],
    ),
    "a value never closed": (
        GLM.format(city="Rome", more="<arg_key>days</arg_key><arg_value>3"),
        GLM.format(city="Rome", more="<arg_key>days</arg_key><arg_value>3"),
        [],
    ),
    "an empty key": (
        GLM.format(city="Rome", more="<arg_key> </arg_key><arg_value>3</arg_value>"),
        GLM.format(city="Rome", more="<arg_key> </arg_key><arg_value>3</arg_value>"),
        [],
    ),
    "text after the arguments": (
        GLM.format(city="Rome", more="stray\n"),
        GLM.format(city="Rome", more="stray\n"),
        [],
    ),
}


def _whole(parser, text: str) -> Parsed:
    return parser.feed(text) + parser.end()


def _streamed(parser, text: str, cuts: list[int]) -> Parsed:
    bounds = [0, *sorted(set(cuts)), len(text)]
    parsed = Parsed()
    for start, end in itertools.pairwise(bounds):
        parsed += parser.feed(text[start:end])
    return parsed + parser.end()


def _calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls(parsed.calls)
    ]


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    parsed = _whole(HermesCalls(), HERMES["calls"])
    assert parsed.content == "Let me check.\n"  # the newlines between blocks are not content
    assert _calls(parsed) == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("time", {"tz": "<tool_call>}"}),
    ]
    ids = [c["id"] for c in whole_calls(parsed.calls)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize(
    ("case", "content", "calls"),
    [
        ("text only", HERMES["text only"], []),
        ("bad json", HERMES["bad json"], []),
        ("unclosed", "", [("get_weather", {"city": "Paris", "unit": "c"})]),
        ("unclosed bad", HERMES["unclosed bad"], []),
        ("partial tag at end", HERMES["partial tag at end"], []),
        ("nested past the recursion limit", HERMES["nested past the recursion limit"], []),
    ],
)
def test_what_is_not_a_whole_call_stays_text(case, content, calls):
    parsed = _whole(HermesCalls(), HERMES[case])
    assert (parsed.content, _calls(parsed)) == (content, calls)


@given(case=st.sampled_from(sorted(HERMES)), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_hermes_streamed_in_any_pieces_adds_up_to_the_whole(case, cuts):
    text = HERMES[case]
    whole, streamed = (
        _whole(HermesCalls(), text),
        _streamed(HermesCalls(), text, [c % (len(text) + 1) for c in cuts]),
    )
    assert streamed.content == whole.content
    assert _calls(streamed) == _calls(whole)


@given(cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_required_call_list_streamed_in_any_pieces_gives_each_call_once_whole(cuts):
    text = json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": 'Pa\\"ris}', "days": [1, {"x": "]"}]}},
            {"name": "time", "arguments": {}},
        ],
        separators=(",", ":"),
    )
    parser = CallList()
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    pieces = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    parsed = sum(pieces, Parsed()) + parser.end()
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": 'Pa\\"ris}', "days": [1, {"x": "]"}]}),
        ("time", {}),
    ]
    assert all(p.id is not None for p in parsed.calls)  # each call goes out whole, in one part


def test_a_named_call_streams_its_arguments_as_they_come():
    parser = NamedCall("get_weather")
    first, second, last = parser.feed('{"city"'), parser.feed(':"Rome"}'), parser.end()
    assert first.calls[0].body()["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert second.calls[0].body() == {"index": 0, "function": {"arguments": ':"Rome"}'}}
    assert last == Parsed()
    assert _calls(first + second) == [("get_weather", {"city": "Rome"})]


# Each parser, with the replies above, their content and their calls.
REPLY_CASES = (
    [(JsonReplyCalls, LLAMA_REPLIES[case]) for case in LLAMA_REPLIES]
    + [(MistralCalls, MISTRAL_REPLIES[case]) for case in MISTRAL_REPLIES]
    + [(functools.partial(XmlCalls, XML_SCHEMAS), XML_REPLIES[case]) for case in XML_REPLIES]
    + [(functools.partial(GlmCalls, XML_SCHEMAS), GLM_REPLIES[case]) for case in GLM_REPLIES]
)


@pytest.mark.parametrize(
    "parser, reply",
    REPLY_CASES,
    ids=[f"llama: {case}" for case in LLAMA_REPLIES]
    + [f"mistral: {case}" for case in MISTRAL_REPLIES]
    + [f"xml: {case}" for case in XML_REPLIES]
    + [f"glm: {case}" for case in GLM_REPLIES],
)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_a_reply_is_calls_or_content_in_any_pieces(parser, reply, cuts):
    text, content, calls = reply
    whole = _whole(parser(), text)
    assert (whole.content, _calls(whole)) == (content, calls)
    streamed = _streamed(parser(), text, [c % (len(text) + 1) for c in cuts])
    assert (streamed.content, _calls(streamed)) == (content, calls)


def test_a_llama_reply_of_text_streams_as_it_comes():
    parser = JsonReplyCalls()
    assert parser.feed("\n ") == Parsed()  # it may yet open with `{`
    assert parser.feed("Sunny") == Parsed(content="\n Sunny")
    assert parser.feed(" {and} warm") == Parsed(content=" {and} warm")
    assert parser.end() == Parsed()


def test_mistral_text_streams_as_it_comes_and_a_call_token_is_held_until_known():
    parser = MistralCalls()
    assert parser.feed("Sunny [TOOL") == Parsed(content="Sunny ")  # "[TOOL" may open the calls
    assert parser.feed("S] and [warm]") == Parsed(content="[TOOLS] and [warm]")
    assert parser.feed(" [TOOL_CALLS]" + MISTRAL) == Parsed()  # space just before calls is not content
    assert _calls(parser.end()) == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_auto_needs_a_template_that_teaches_a_format_and_the_others_do_not():
    with pytest.raises(ApiError, match="teaches it no tool-call format") as raised:
        parser_for("auto", "", {})
    assert raised.value.param == "tool_choice"
    assert parser_for("auto", "hermes", {}) is HermesCalls
    assert parser_for("auto", "llama3_json", {}) is JsonReplyCalls
    assert parser_for("auto", "mistral", {}) is MistralCalls
    xml = parser_for("auto", "qwen3_xml", XML_SCHEMAS)()
    assert isinstance(xml, XmlCalls) and _calls(_whole(xml, XML_REPLIES["values by their schema"][0]))
    glm = parser_for("auto", "glm45", XML_SCHEMAS)()
    assert isinstance(glm, GlmCalls) and _calls(_whole(glm, GLM_REPLIES["values by their schema"][0]))
    assert parser_for("required", "", {}) is CallList
    assert parser_for("none", "hermes", {}) is None
    named = parser_for(NamedToolChoice(type="function", function=FunctionName(name="f")), "", {})
    assert isinstance(named(), NamedCall)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner, max_size=3),
    max_leaves=10,
)
VALUES = st.sampled_from(["x", "12", "true", "True", "null", '{"k": [1]}', "a\nb", ""])
XML_CALLS = st.lists(st.tuples(st.sampled_from("ab"), VALUES), max_size=3).map(
    lambda parameters: (
        "<tool_call>\n<function=f>\n"
        + "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
        + "</function>\n</tool_call>"
    )
)


CALL_OF_A = "<tool_call>\n<function=f>\n<parameter=a>\n12\n</parameter>\n</function>\n</tool_call>"


@given(schema=JSON, text=XML_CALLS, cuts=st.lists(st.integers(0, 200), max_size=8))
@example(schema=5, text=CALL_OF_A, cuts=[])
@example(schema={"properties": 5}, text=CALL_OF_A, cuts=[])
@example(schema={"properties": {"a": 5}}, text=CALL_OF_A, cuts=[])
def test_xml_calls_read_under_any_schema_the_same_whole_and_streamed(schema, text, cuts):
    """Whatever a client's schema for `f` holds, its calls are read, and the pieces a stream
    brings add up to the whole."""
    schemas = {"f": schema}
    whole = _whole(XmlCalls(schemas), text)
    streamed = _streamed(XmlCalls(schemas), text, [c % (len(text) + 1) for c in cuts])
    assert [name for name, _ in _calls(whole)] == ["f"]
    assert (streamed.content, _calls(streamed)) == (whole.content, _calls(whole))
