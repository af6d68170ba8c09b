"""`tool_choice: "auto"` on a model whose chat template teaches Qwen3-Coder's XML tool calls
(tests/qwen3_xml_chat_template.jinja): <tool_call> blocks of <function=...> and <parameter=...>
tags are read into `tool_calls`, whole and streamed, each value by the tool's schema, with the text
before them as content; the calls carried back render. The model has random weights, so a regex
constraint makes it write a call (vLLM's `structured_outputs` beside tools; the grammar `"auto"`
holds calls to itself: test_auto_tool_grammar.py)."""

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

TEMPLATE = Path(__file__).parents[1] / "qwen3_xml_chat_template.jinja"
CALL = (
    r"Sure\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
    r"<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def xml_client(tmp_path_factory, chat_model, store):
    yield from client_on_template(tmp_path_factory, chat_model, store, TEMPLATE)


def test_an_xml_block_becomes_a_tool_call_whole_and_streamed(xml_client):
    client, model = xml_client
    calls = one_call_whole_and_streamed(client, model, WEATHER, MESSAGES, {"regex": CALL}, "Sure.\n")
    assert all(isinstance(arguments["days"], int) for arguments in calls)  # as the schema says, not text


def test_a_string_value_stays_text_though_it_reads_as_json(xml_client):
    """The gateway reads values by the request's own tools: 12 of a string parameter is the text
    "12", not the number."""
    client, model = xml_client
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
    written = r"<tool_call>\n<function=lookup>\n<parameter=code>\n12\n</parameter>\n</function>\n</tool_call>"
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[lookup],
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": written}},
    ).choices[0]
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"code": "12"}


def test_the_calls_carried_back_render_and_are_answered(xml_client):
    client, model = xml_client
    reply = answer_after_a_call(client, model, [WEATHER], MESSAGES, {"regex": CALL})
    assert reply.finish_reason == "stop" and reply.message.content.startswith("It is ")


@pytest.mark.parametrize("seed", [3, 4])
def test_calls_under_auto_alone_follow_the_tools_schemas(xml_client, seed):
    """No other constraint: the worker samples under the gateway's grammar for the tools."""
    client, model = xml_client
    calls_under_auto_alone(client, model, WEATHER, MESSAGES, seed)
