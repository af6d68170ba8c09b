"""`tool_choice: "auto"` on a model whose chat template teaches Llama 3's JSON tool calls
(tests/llama3_chat_template.jinja): a reply that opens with `{` is read into `tool_calls`, whole and
streamed, any other reply is content, and calls are held to the tools' schemas (the grammar
itself: test_auto_tool_grammar.py). The model has random weights, so a regex constraint makes it
write a call (vLLM's `structured_outputs` beside tools)."""

import json
from pathlib import Path

import jsonschema
import pytest

from .conftest import client_on_template, whole_and_streamed
from .test_auto_tool_calls import MESSAGES, WEATHER

TEMPLATE = Path(__file__).parents[1] / "llama3_chat_template.jinja"
CALL = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'


@pytest.fixture(scope="module")
def llama_client(tmp_path_factory, chat_model, store):
    yield from client_on_template(tmp_path_factory, chat_model, store, TEMPLATE)


def test_a_json_reply_becomes_a_tool_call_whole_and_streamed(llama_client):
    client, model = llama_client
    ask = dict(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": CALL}},
    )
    for choice in whole_and_streamed(client, **ask):
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_text_reply_is_content(llama_client):
    client, model = llama_client
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": "Sunny, [a-z]{4}"}},
    ).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("Sunny, ")


@pytest.mark.parametrize("seed", [3, 4])
def test_replies_under_auto_alone_are_calls_of_the_tools_or_text(llama_client, seed):
    """No other constraint: the worker samples under the gateway's grammar for the tools, so a
    reply is text that does not open with `{`, or calls that follow the schema."""
    client, model = llama_client
    choice = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER], max_tokens=32, temperature=1.0, seed=seed
    ).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert not choice.message.content.lstrip().startswith("{")
