"""`tool_choice: "auto"` on a model whose chat template teaches GLM-4.5's tool calls
(tests/glm45_chat_template.jinja): <tool_call> blocks of the function's name, then an <arg_key>
and an <arg_value> tag for each argument, are read into `tool_calls`, whole and streamed, each
value by the tool's schema, with the text before them as content; the calls carried back render.
The model has random weights, so a regex constraint makes it write a call (vLLM's
`structured_outputs` beside tools; the grammar `"auto"` holds calls to itself:
test_auto_tool_grammar.py)."""

from pathlib import Path

import pytest

from .conftest import (
    answer_after_a_call,
    calls_under_auto_alone,
    client_on_template,
    one_call_whole_and_streamed,
)
from .test_auto_tool_calls import MESSAGES, WEATHER

TEMPLATE = Path(__file__).parents[1] / "glm45_chat_template.jinja"
CALL = (
    r"Sure\.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>(Paris|Rome)</arg_value>\n"
    r"<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n</tool_call>"
)


@pytest.fixture(scope="module")
def glm_client(tmp_path_factory, chat_model, store):
    yield from client_on_template(tmp_path_factory, chat_model, store, TEMPLATE)


def test_a_block_of_tags_becomes_a_tool_call_whole_and_streamed(glm_client):
    client, model = glm_client
    calls = one_call_whole_and_streamed(client, model, WEATHER, MESSAGES, {"regex": CALL}, "Sure.\n")
    assert all(isinstance(arguments["days"], int) for arguments in calls)  # as the schema says, not text


def test_the_calls_carried_back_render_and_are_answered(glm_client):
    client, model = glm_client
    reply = answer_after_a_call(client, model, [WEATHER], MESSAGES, {"regex": CALL})
    assert reply.finish_reason == "stop" and reply.message.content.startswith("It is ")


def test_calls_under_auto_alone_follow_the_tools_schemas(glm_client):
    """No other constraint: the worker samples under the gateway's grammar for the tools."""
    client, model = glm_client
    calls_under_auto_alone(client, model, WEATHER, MESSAGES, seed=3)
