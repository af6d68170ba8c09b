"""`tool_choice: "auto"` on models whose chat templates teach tool calls written in tags: Qwen3-
Coder's (tests/qwen3_xml_chat_template.jinja: <tool_call> blocks of <function=...> and
<parameter=...> tags) and GLM-4.5's (tests/glm45_chat_template.jinja: <tool_call> blocks of the
function's name, then an <arg_key> and an <arg_value> tag for each argument). Blocks are read into
`tool_calls`, whole and streamed, each value by the tool's schema, with the text before them as
content; the calls carried back render. The model has random weights, so a regex constraint makes
it write a call (vLLM's `structured_outputs` beside tools; the grammar `"auto"` holds calls to
itself: test_auto_tool_grammar.py)."""

import json
from pathlib import Path

import pytest

from .conftest import (
    answer_after_a_call,
    calls_under_auto_alone,
    client_on_template,
    one_call_whole_and_streamed,
)
from .test_auto_tool_calls import MESSAGES, WEATHER

TEMPLATES = Path(__file__).parents[1]
# Each format's template, and a regex of a block holding a call of `{name}` with `{key}` = `{value}`.
FORMATS = {
    "qwen3_xml": (
        TEMPLATES / "qwen3_xml_chat_template.jinja",
        r"<tool_call>\n<function={name}>\n<parameter={key}>\n{value}\n</parameter>\n{more}</function>\n</tool_call>",
    ),
    "glm45": (
        TEMPLATES / "glm45_chat_template.jinja",
        r"<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n{more}</tool_call>",
    ),
}
MORE_DAYS = {  # the weather call's second parameter, in each format
    "qwen3_xml": r"<parameter=days>\n[1-7]\n</parameter>\n",
    "glm45": r"<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n",
}


@pytest.fixture(scope="module", params=list(FORMATS))
def tagged(request, tmp_path_factory, chat_model, store):
    """The official client on a worker of the format's template, the model's name, and a regex of
    a weather call in that format."""
    template, block = FORMATS[request.param]
    call = r"Sure\.\n" + block.format(
        name="get_weather", key="city", value="(Paris|Rome)", more=MORE_DAYS[request.param]
    )
    for client, model in client_on_template(tmp_path_factory, chat_model, store, template):
        yield client, model, call, block


def test_a_block_becomes_a_tool_call_whole_and_streamed(tagged):
    client, model, call, _ = tagged
    calls = one_call_whole_and_streamed(client, model, WEATHER, MESSAGES, {"regex": call}, "Sure.\n")
    assert all(isinstance(arguments["days"], int) for arguments in calls)  # as the schema says, not text


def test_a_string_value_stays_text_though_it_reads_as_json(tagged):
    """The gateway reads values by the request's own tools: 12 of a string parameter is the text
    "12", not the number."""
    client, model, _, block = tagged
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
    written = block.format(name="lookup", key="code", value="12", more="")
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[lookup],
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": written}},
    ).choices[0]
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"code": "12"}


def test_the_calls_carried_back_render_and_are_answered(tagged):
    client, model, call, _ = tagged
    reply = answer_after_a_call(client, model, [WEATHER], MESSAGES, {"regex": call})
    assert reply.finish_reason == "stop" and reply.message.content.startswith("It is ")


@pytest.mark.parametrize("seed", [3, 4])
def test_calls_under_auto_alone_follow_the_tools_schemas(tagged, seed):
    """No other constraint: the worker samples under the gateway's grammar for the tools."""
    client, model, _, _ = tagged
    calls_under_auto_alone(client, model, WEATHER, MESSAGES, seed)
