"""`tool_choice: "auto"` on a Hermes chat template: the grammar the gateway sends holds each
<tool_call> block the model opens to a call of one of the tools, with arguments of that tool's
schema, and leaves the text outside blocks free. Checked with the worker's own grammar engine
(Grammars: llguidance on the default model's tokenizer): the texts it takes and refuses, and what
decoding under its masks writes once a block is open. The same for Qwen3-Coder's XML blocks,
Llama 3's JSON replies and Mistral's [TOOL_CALLS] arrays (on the default vocabulary with that
special token in it)."""

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from inference_service.engine.grammars import Grammars, mask_rows
from inference_service.sampling import Structured
from openai_gateway.constraints import constrains_from_the_start, constraint
from openai_gateway.protocol import ChatCompletionRequest
from openai_gateway.tool_calls import (
    GlmCalls,
    HermesCalls,
    JsonReplyCalls,
    MistralCalls,
    XmlCalls,
    whole_calls,
)
from shared.errors import InvalidArgument
from tests.conftest import MISTRAL_CALLS_ID, with_mistral_calls_token

from .test_auto_tool_calls import WEATHER

CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","days":3}}\n</tool_call>'
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": {"type": "object", "additionalProperties": False},
}


def request(
    parallel: bool = True, tools: tuple[dict, ...] = (WEATHER, CLOCK), **more
) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    return ChatCompletionRequest(
        model="m", messages=messages, tools=list(tools), parallel_tool_calls=parallel, **more
    )


def matcher(grammars: Grammars, parallel: bool, tool_format: str = "hermes"):
    call_token = MISTRAL_CALLS_ID if tool_format == "mistral" else None
    sent = constraint(request(parallel), tool_format=tool_format, call_token=call_token)
    return grammars.matcher(Structured("grammar", sent["grammar"]))


def takes(
    grammars: Grammars, text_tokenizer: Tokenizer, parallel: bool, text: str, tool_format: str = "hermes"
) -> bool:
    """Whether the grammar takes the whole of `text` and may end there."""
    m = matcher(grammars, parallel, tool_format)
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "text, taken_when_parallel, taken_alone",
    [
        ("No call is needed.", True, True),
        ("Sure. " + CALL, True, True),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True, True),
        (CALL + "\n" + CALL, True, False),  # two calls: parallel_tool_calls false takes one
        (CALL + " and some text", True, False),  # after its one call, only space
        (CALL.replace('"days":3', '"days":9'), False, False),  # past the schema's maximum
        (CALL.replace('"Paris"', '"Oslo"'), False, False),  # outside the enum
        (CALL.replace("get_weather", "get_wether"), False, False),  # no such tool
        (CALL.replace('"days":3', '"days":3,"unit":"C"'), False, False),  # no such argument
        (CALL + "\n" + CALL.replace("get_weather", "get_wether"), False, False),
    ],
)
def test_the_grammar_takes_free_text_and_calls_of_the_tools_only(
    grammars, text_tokenizer, parallel, text, taken_when_parallel, taken_alone
):
    assert takes(grammars, text_tokenizer, parallel, text) == (
        taken_when_parallel if parallel else taken_alone
    )


def written_until_closed(m, text_tokenizer: Tokenizer, seed: int) -> str:
    """What greedy decoding of random logits under the matcher's masks writes until a block
    closes (at most 300 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = []
    while "</tool_call>" not in text_tokenizer.decode(ids) and len(ids) < 300:
        logits = torch.randn(1, text_tokenizer.get_vocab_size(), generator=generator)  # [1, vocab]
        token = int(mask_rows(logits, [m]).argmax())
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    return text_tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(4))
def test_decoding_under_its_masks_writes_a_valid_call_once_a_block_opens(grammars, text_tokenizer, seed):
    """Random logits stand for a model that knows no tool: once it opens a block, the masks leave
    it only calls of the tools with arguments of their schemas, and the gateway reads one."""
    m = matcher(grammars, parallel=True)
    text = "Sure. <tool_call>"
    assert m.consume_tokens(text_tokenizer.encode(text, add_special_tokens=False).ids)
    written = text + written_until_closed(m, text_tokenizer, seed)
    parser = HermesCalls()
    parsed = parser.feed(written)
    parsed += parser.end()
    [call] = whole_calls(parsed.calls)
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[name])
    after = written.split("</tool_call>", 1)[1]  # what the tag's last token brought past it
    assert parsed.content == "Sure. " + (after if after.strip() else "")


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
NOTED = {  # a tool with a text argument, an optional number and a boolean
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "weight": {"type": "number"},
                "pinned": {"type": "boolean"},
                "tag": {"type": ["string", "null"]},
            },
            "required": ["text"],
        },
    },
}


def tagged_takes(
    grammars: Grammars, text_tokenizer: Tokenizer, parallel: bool, text: str, tool_format: str = "qwen3_xml"
) -> bool:
    sent = constraint(request(parallel, tools=[WEATHER, CLOCK, NOTED]), tool_format=tool_format)
    m = grammars.matcher(Structured("grammar", sent["grammar"]))
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


def note(body: str) -> str:
    return f"<tool_call>\n<function=note>\n{body}</function>\n</tool_call>"


# (a reply, whether the grammar takes it with parallel_tool_calls, and without), in each format of tags
XML_CASES = [
    ("No call is needed.", True, True),
    ("Sure. " + XML_CALL, True, True),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", True, True),
    (note("<parameter=text>\ntwo\nlines < and </param\n</parameter>\n"), True, True),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=weight>\n2.5\n</parameter>\n"), True, True),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=pinned>\nTrue\n</parameter>\n"), True, True),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=pinned>\nyes\n</parameter>\n"), False, False),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=tag>\nnull\n</parameter>\n"), True, True),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=tag>\n[1]\n</parameter>\n"), True, True),
    (note("<parameter=weight>\n2.5\n</parameter>\n"), False, False),  # text is required
    (note("<parameter=weight>\n1\n</parameter>\n<parameter=text>\nx\n</parameter>\n"), False, False),
    (note("<parameter=text>\nx\n</parameter>\n<parameter=weight>\nheavy\n</parameter>\n"), False, False),
    (XML_CALL + "\n" + XML_CALL, True, False),  # two calls: parallel_tool_calls false takes one
    (XML_CALL.replace("\n3\n", "\n9\n"), False, False),  # past the schema's maximum
    (XML_CALL.replace("Paris", "Oslo"), False, False),  # outside the enum
    (XML_CALL.replace("get_weather", "get_wether"), False, False),  # no such tool
    (XML_CALL.replace("=days", "=hours"), False, False),  # no such parameter
]


def glm_note(body: str) -> str:
    return f"<tool_call>note\n{body}</tool_call>"


def arg(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"


GLM_CALL = "<tool_call>get_weather\n" + arg("city", "Paris") + arg("days", "3") + "</tool_call>"
GLM_CASES = [
    ("No call is needed.", True, True),
    ("Sure. " + GLM_CALL, True, True),
    ("<tool_call>get_time\n</tool_call>", True, True),
    (glm_note(arg("text", "two\nlines < and </arg_val")), True, True),
    (glm_note(arg("text", "x") + arg("weight", "2.5")), True, True),
    (glm_note(arg("text", "x") + arg("pinned", "true")), True, True),
    (glm_note(arg("text", "x") + arg("pinned", "yes")), False, False),
    (glm_note(arg("text", "x") + arg("tag", "null")), True, True),
    (glm_note(arg("weight", "2.5")), False, False),  # text is required
    (glm_note(arg("weight", "1") + arg("text", "x")), False, False),  # in the schema's order
    (glm_note(arg("text", "x") + arg("weight", "heavy")), False, False),
    (GLM_CALL + "\n" + GLM_CALL, True, False),  # two calls: parallel_tool_calls false takes one
    (GLM_CALL.replace(">3<", ">9<"), False, False),  # past the schema's maximum
    (GLM_CALL.replace("Paris", "Oslo"), False, False),  # outside the enum
    (GLM_CALL.replace("get_weather", "get_wether"), False, False),  # no such tool
    (GLM_CALL.replace(">days<", ">hours<"), False, False),  # no such parameter
]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "tool_format, text, taken_when_parallel, taken_alone",
    [("qwen3_xml", *case) for case in XML_CASES] + [("glm45", *case) for case in GLM_CASES],
)
def test_tagged_grammars_take_free_text_and_calls_of_the_tools_only(
    grammars, text_tokenizer, parallel, tool_format, text, taken_when_parallel, taken_alone
):
    assert tagged_takes(grammars, text_tokenizer, parallel, text, tool_format) == (
        taken_when_parallel if parallel else taken_alone
    )


@pytest.mark.parametrize("tool_format, parser", [("qwen3_xml", XmlCalls), ("glm45", GlmCalls)])
@pytest.mark.parametrize("seed", range(4))
def test_decoding_under_tagged_masks_writes_a_valid_call_once_a_block_opens(
    grammars, text_tokenizer, seed, tool_format, parser
):
    """Random logits after <tool_call>: the masks leave only a call of one of the tools whose
    values the gateway reads into arguments of its schema (tools without free text, which random
    logits would write on and on)."""
    sent = constraint(request(True), tool_format=tool_format)
    m = grammars.matcher(Structured("grammar", sent["grammar"]))
    text = "<tool_call>"
    assert m.consume_tokens(text_tokenizer.encode(text, add_special_tokens=False).ids)
    parser = parser(SCHEMAS)
    parsed = parser.feed(text + written_until_closed(m, text_tokenizer, seed))
    parsed += parser.end()
    [call] = whole_calls(parsed.calls)
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
# Parameter schemas as a client may write them, sane or not: typed properties, enums, requirements.
PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["object", "string"]) | JSON,
        "properties": st.dictionaries(
            st.text(max_size=6),
            st.fixed_dictionaries(
                {}, optional={"type": st.sampled_from(["string", "integer", "boolean", "array"]) | JSON}
            )
            | JSON,
            max_size=3,
        )
        | JSON,
        "required": st.lists(st.text(max_size=6), max_size=2) | JSON,
        "enum": JSON,
        "anyOf": JSON,
    },
)


@pytest.mark.parametrize("tool_format", ["qwen3_xml", "glm45"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parameters=PARAMETERS)
@example(parameters={"properties": {"a": {"type": "string"}}, "required": 5})
@example(parameters={"properties": {"a": 5, "b": {"type": "integer"}}})
@example(parameters={"properties": 5})
@example(parameters={"properties": {"a<b": {"type": "string"}, "c>d": {}}})
def test_any_parameter_schema_makes_a_tagged_grammar_or_a_refusal_by_name(grammars, parameters, tool_format):
    """Whatever a tool's schema holds, the gateway builds the grammar of tags without failing, and
    the worker compiles it or refuses it with a message (a 400), never an error of its own."""
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    sent = constraint(request(True, tools=[tool]), tool_format=tool_format)
    try:
        grammars.matcher(Structured("grammar", sent["grammar"]))
    except InvalidArgument as e:
        assert str(e).startswith("structured output grammar: ")


def decoded_to_the_end(m, vocab_size: int, seed: int) -> list[int]:
    """What greedy decoding of random logits under the matcher's masks writes until the grammar
    ends it (at most 300 tokens), EOS (id 2) left out."""
    generator = torch.Generator().manual_seed(seed)
    ids = []
    while not m.is_stopped() and len(ids) < 300:
        logits = torch.randn(1, vocab_size, generator=generator)  # [1, vocab]
        token = int(mask_rows(logits, [m]).argmax())
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    return [i for i in ids if i != 2]


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city":"Paris","days":3}}'


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "text, taken_when_parallel, taken_alone",
    [
        ("No call is needed.", True, True),
        ("Sure. " + LLAMA_CALL, True, True),  # opens with text: all of it is content
        ("", True, True),
        (LLAMA_CALL, True, True),
        ("\n" + LLAMA_CALL, True, True),
        (LLAMA_CALL + "\n", False, False),  # the reply ends with its last call
        ('{"name": "get_time", "parameters": {}}', True, True),
        (LLAMA_CALL + "; " + LLAMA_CALL, True, False),  # two calls: parallel_tool_calls false takes one
        (LLAMA_CALL + " and some text", False, False),  # a reply that opens with `{` is calls only
        ('{"city": "Paris"}', False, False),
        (LLAMA_CALL.replace('"days":3', '"days":9'), False, False),  # past the schema's maximum
        (LLAMA_CALL.replace("get_weather", "get_wether"), False, False),  # no such tool
        (LLAMA_CALL.replace('"parameters"', '"arguments"'), False, False),  # Llama's key is parameters
    ],
)
def test_llamas_grammar_takes_text_or_calls_of_the_tools_only(
    grammars, text_tokenizer, parallel, text, taken_when_parallel, taken_alone
):
    taken = takes(grammars, text_tokenizer, parallel, text, "llama3_json")
    assert taken == (taken_when_parallel if parallel else taken_alone)


@pytest.mark.parametrize("seed", range(4))
def test_decoding_under_llamas_masks_writes_valid_calls_once_a_reply_opens_with_a_brace(
    grammars, text_tokenizer, seed
):
    """Random logits after `{`: the masks leave only a call of one of the tools with arguments of
    its schema, then the reply's end, and the gateway reads it."""
    m = matcher(grammars, parallel=False, tool_format="llama3_json")
    assert m.consume_tokens(text_tokenizer.encode("{", add_special_tokens=False).ids)
    reply = "{" + text_tokenizer.decode(decoded_to_the_end(m, text_tokenizer.get_vocab_size(), seed))
    parser = JsonReplyCalls()
    parsed = parser.feed(reply)
    parsed += parser.end()
    assert m.is_stopped() and parsed.content == ""
    [call] = whole_calls(parsed.calls)
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.fixture(scope="module")
def mistral_tokenizer(default_model_dir, tmp_path_factory) -> Path:
    """tokenizer.json of the default vocabulary with [TOOL_CALLS] a special token (id 5)."""
    path = tmp_path_factory.mktemp("mistral") / "tokenizer.json"
    path.write_text(with_mistral_calls_token((default_model_dir / "tokenizer.json").read_text()))
    return path


@pytest.fixture(scope="module")
def mistral_text(mistral_tokenizer) -> Tokenizer:
    return Tokenizer.from_file(str(mistral_tokenizer))


@pytest.fixture(scope="module")
def mistral_grammars(mistral_tokenizer, mistral_text):
    grammars = Grammars(mistral_tokenizer, mistral_text.get_vocab_size(), (2,), timeout_s=60)
    yield grammars
    grammars.close()


MISTRAL_CALL = '{"name": "get_weather", "arguments": {"city":"Paris","days":3}}'


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "text, taken_when_parallel, taken_alone",
    [
        ("No call is needed: [1, 2].", True, True),
        ("", True, True),
        (f"[TOOL_CALLS] [{MISTRAL_CALL}]", True, True),
        (f"[TOOL_CALLS][{MISTRAL_CALL}]", True, True),
        (f"Sure.[TOOL_CALLS] [{MISTRAL_CALL}]", True, True),  # text before the token is content
        (f'[TOOL_CALLS] [{MISTRAL_CALL[:-1]}, "id": "a1b2c3d4e"}}]', True, True),  # as templates write
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', True, True),
        (f"[TOOL_CALLS] [{MISTRAL_CALL}, {MISTRAL_CALL}]", True, False),  # not parallel: one call
        (f"[TOOL_CALLS] [{MISTRAL_CALL}] done", False, False),  # the array ends the reply
        ("[TOOL_CALLS] []", False, False),
        (f"[TOOL_CALLS] {MISTRAL_CALL}", False, False),  # an array, not a bare call
        (f'[TOOL_CALLS] [{MISTRAL_CALL[:-1]}, "id": "short"}}]', False, False),
        ("[TOOL_CALLS] [" + MISTRAL_CALL.replace('"days":3', '"days":9') + "]", False, False),
        ("[TOOL_CALLS] [" + MISTRAL_CALL.replace("get_weather", "get_wether") + "]", False, False),
        ("[TOOL_CALLS] [" + MISTRAL_CALL.replace('"arguments"', '"parameters"') + "]", False, False),
    ],
)
def test_mistrals_grammar_takes_text_then_calls_of_the_tools_only(
    mistral_grammars, mistral_text, parallel, text, taken_when_parallel, taken_alone
):
    assert MISTRAL_CALLS_ID in mistral_text.encode(text).ids or "[TOOL_CALLS]" not in text
    taken = takes(mistral_grammars, mistral_text, parallel, text, "mistral")
    assert taken == (taken_when_parallel if parallel else taken_alone)


@pytest.mark.parametrize("seed", range(4))
def test_decoding_under_mistrals_masks_writes_valid_calls_after_the_call_token(
    mistral_grammars, mistral_text, seed
):
    """Random logits after [TOOL_CALLS]: the masks leave only an array of calls of the tools with
    arguments of their schemas, then the reply's end, and the gateway reads it."""
    m = matcher(mistral_grammars, parallel=True, tool_format="mistral")
    assert m.consume_token(MISTRAL_CALLS_ID)
    ids = decoded_to_the_end(m, mistral_text.get_vocab_size(), seed)
    reply = mistral_text.decode([MISTRAL_CALLS_ID, *ids], skip_special_tokens=False)
    parser = MistralCalls()
    parsed = parser.feed(reply)
    parsed += parser.end()
    assert m.is_stopped() and parsed.content == ""
    calls = whole_calls(parsed.calls)
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_another_constraint_given_with_auto_is_the_one_held():
    """As vLLM's `structured_outputs` beside tools: the caller's constraint, alone."""
    given = request(structured_outputs={"regex": "No call: [a-z]{4}"})
    assert constraint(given, tool_format="hermes") == {"regex": "No call: [a-z]{4}"}
    assert constraint(request(), tool_format="") == {}  # a template without a format: nothing to hold


def sent_schemas(tools: list[dict]) -> list[dict]:
    """The tools' schemas as auto's grammar carries them (each after `%json`, one per line)."""
    grammar = constraint(request_with(tools), tool_format="hermes")["grammar"]
    return [json.loads(line.split(" %json ", 1)[1]) for line in grammar.splitlines() if " %json " in line]


def request_with(tools: list[dict]) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "?"}], tools=tools)


def test_the_grammar_carries_the_schemas_without_their_annotations():
    """Descriptions, titles, examples and defaults constrain nothing; a property named like one,
    and enum values, stay."""
    described = {"type": "string", "description": "The city.", "title": "City", "examples": ["Paris"]}
    parameters = {
        "type": "object",
        "title": "Arguments",
        "properties": {
            "city": described,
            "description": {"type": "string", "enum": ["title", "description"], "default": "title"},
            "stops": {"type": "array", "items": {"type": "string", "description": "A stop."}},
        },
        "anyOf": [{"required": ["city"], "description": "by city"}, {"required": ["description"]}],
    }
    tool = {"type": "function", "function": {"name": "route", "parameters": parameters}}
    [schema] = sent_schemas([tool])
    assert schema == {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "description": {"type": "string", "enum": ["title", "description"]},
            "stops": {"type": "array", "items": {"type": "string"}},
        },
        "anyOf": [{"required": ["city"]}, {"required": ["description"]}],
        "x-guidance": {"whitespace_flexible": False},
    }


def test_many_described_tools_fit_a_constraint():
    """128 tools (OpenAI's most) of 10 described arguments each: what their descriptions would
    take past a constraint's 64 KiB is left out."""
    words = "The value this argument takes, in the units the caller uses. " * 2
    arguments = {f"argument_{i}": {"type": "string", "description": words} for i in range(10)}
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{k}", "parameters": {"type": "object", "properties": arguments}},
        }
        for k in range(128)
    ]
    assert len(json.dumps([t["function"]["parameters"] for t in tools])) > 64 << 10
    grammar = constraint(request_with(tools), tool_format="hermes")["grammar"]
    assert len(grammar) <= 64 << 10
    assert round(len(grammar) / 1000, 1) == 57.8  # README's figure: the schemas written compact
    Structured("grammar", grammar)  # the worker's own bound on a constraint's text


@pytest.mark.parametrize(
    "extra, forced",
    [
        ({}, False),
        ({"tool_choice": "auto"}, False),  # auto's grammar leaves the text before a call free
        ({"tool_choice": "none"}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"tool_choice": "required"}, True),
        ({"response_format": {"type": "json_object"}}, True),
        ({"structured_outputs": {"regex": "a"}}, True),
    ],
)
def test_what_holds_a_reply_from_its_first_token(extra, forced):
    assert constrains_from_the_start(request(**extra)) == forced
