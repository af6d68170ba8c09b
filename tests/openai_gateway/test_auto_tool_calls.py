"""`tool_choice: "auto"` on a model whose chat template teaches Hermes' tool-call format
(tests/hermes_chat_template.jinja): the gateway reads <tool_call> blocks from the model's text
into `tool_calls`, whole and streamed, with the text before them as content, and holds the blocks
to the tools' schemas (the grammar itself: test_auto_tool_grammar.py). The model has random
weights, so a regex constraint makes it write a call (vLLM's `structured_outputs` beside tools)."""

from pathlib import Path

import openai
import pytest

from . import test_fitted_tools as fitted_tools
from .conftest import calls_under_auto_alone, client_on_template, one_call_whole_and_streamed

TEMPLATE = Path(__file__).parents[1] / "hermes_chat_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CALL = (
    r'Sure\. <tool_call>\n\{"name": "get_weather", '
    r'"arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
)
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def hermes_client(tmp_path_factory, chat_model, store):
    yield from client_on_template(tmp_path_factory, chat_model, store, TEMPLATE)


def test_a_hermes_block_becomes_a_tool_call_whole_and_streamed(hermes_client):
    client, model = hermes_client
    one_call_whole_and_streamed(client, model, WEATHER, MESSAGES, {"regex": CALL}, "Sure. ")


def test_text_without_a_block_is_content(hermes_client):
    client, model = hermes_client
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": "No call: [a-z]{4}"}},
    ).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("No call: ")


def test_calls_under_auto_alone_follow_the_tools_schemas(hermes_client):
    """No other constraint: the worker samples under the gateway's grammar for the tools."""
    client, model = hermes_client
    calls_under_auto_alone(client, model, WEATHER, MESSAGES, seed=3)


def test_a_schema_the_grammar_engine_cannot_hold_is_refused_under_auto(hermes_client):
    """As under "required" or a named tool: a 400 naming what cannot be held, not calls nobody
    checked."""
    client, model = hermes_client
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    tool = {
        "type": "function",
        "function": {"name": "tag", "parameters": {"type": "object", "properties": {"tags": tags}}},
    }
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES, tools=[tool], max_tokens=4)
    assert "uniqueItems" in raised.value.message


def test_strict_tools_past_a_constraints_bound_are_refused(hermes_client):
    """128 strict tools of 10 required arguments: their schemas do not fit one constraint, and
    none may be left out (test_fitted_tools.py). Tools that do fit once the others' schemas are
    left out make a prompt of 25,000 tokens, past this model's context: the grammar they make is
    compiled by the worker's own engine there."""
    client, model = hermes_client
    tools = fitted_tools.tools(strict=range(128))
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, max_tokens=4)
    assert "strict tools" in raised.value.message and raised.value.body["param"] == "tools"
