"""`tool_choice: "auto"` on a model whose chat template teaches Mistral's tool calls
(tests/mistral_chat_template.jinja, over the default vocabulary with [TOOL_CALLS] one of its
special tokens): after that token, a JSON array of calls is read into `tool_calls`, whole and
streamed, the text before it is content, and a conversation that carries the calls back renders
though Mistral's templates take only nine-character ids. The model has random weights, so a Lark
grammar (vLLM's `structured_outputs` beside tools) makes it write the token and a call (the
grammar `"auto"` holds calls to itself: test_auto_tool_grammar.py)."""

from pathlib import Path

import pytest

from tests.conftest import MISTRAL_CALLS_ID, with_mistral_calls_token

from .conftest import (
    answer_after_a_call,
    calls_under_auto_alone,
    client_on_template,
    one_call_whole_and_streamed,
)
from .test_auto_tool_calls import MESSAGES, WEATHER

TEMPLATE = Path(__file__).parents[1] / "mistral_chat_template.jinja"
CALL = (
    f'start: TEXT <[{MISTRAL_CALLS_ID}]> " [{{\\"name\\": \\"get_weather\\", \\"arguments\\": '
    '{\\"city\\": \\"" ("Paris" | "Rome") "\\", \\"days\\": " /[1-7]/ "}}]"\n'
    'TEXT: "Let me check."\n'
)


@pytest.fixture(scope="module")
def mistral_client(tmp_path_factory, chat_model, store):
    tokenizer_json = with_mistral_calls_token((chat_model / "tokenizer.json").read_text())
    yield from client_on_template(tmp_path_factory, chat_model, store, TEMPLATE, tokenizer_json)


def test_an_array_after_the_call_token_becomes_tool_calls_whole_and_streamed(mistral_client):
    client, model = mistral_client
    one_call_whole_and_streamed(client, model, WEATHER, MESSAGES, {"grammar": CALL}, "Let me check.")


def test_text_without_the_call_token_is_content(mistral_client):
    client, model = mistral_client
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": r"Sunny \[[a-z]{4}\]"}},
    ).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("Sunny [")


def test_the_calls_and_their_results_carried_back_render(mistral_client):
    """OpenAI's ids (call_ and 24 hex digits) are not the nine characters Mistral's templates
    take: the worker turns them into nine, so the next turn is answered, not refused."""
    client, model = mistral_client
    reply = answer_after_a_call(client, model, [WEATHER], MESSAGES, {"grammar": CALL})
    assert reply.finish_reason == "stop" and reply.message.content.startswith("It is ")


@pytest.mark.parametrize("seed", [3, 4])
def test_replies_under_auto_alone_are_text_or_calls_of_the_tools(mistral_client, seed):
    """No other constraint: the worker samples under the gateway's grammar, which names the call
    token by the id the worker's model info gives."""
    client, model = mistral_client
    calls_under_auto_alone(client, model, WEATHER, MESSAGES, seed)
