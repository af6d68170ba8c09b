"""A thinking model's <think> block through the gateway with the official client: on a template in
Qwen3's style the block a reply opens goes out as `reasoning_content` (vLLM's and DeepSeek's field),
whole and streamed, and the rest as content; on one in DeepSeek-R1's style, whose generation prompt
opens the block, the reply is reasoning until </think>. A request's constraint holds what follows
the block, the block's text left free; on a worker started with --constrain-reasoning it holds the
whole reply, so a reply it holds from the first token is the answer. The model has random weights,
so a regex constraint on such a worker makes it write the reply where a test needs one."""

import re
from pathlib import Path

import openai
import pytest

from .conftest import client_on_template
from .test_auto_tool_calls import MESSAGES, WEATHER

TEMPLATES = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def think_client(tmp_path_factory, chat_model, store):
    """A Qwen3-style template on a worker whose constraints hold the whole reply."""
    template = TEMPLATES / "think_chat_template.jinja"
    yield from client_on_template(
        tmp_path_factory, chat_model, store, template, None, "--constrain-reasoning"
    )


@pytest.fixture(scope="module")
def opened_client(tmp_path_factory, chat_model, store):
    template = TEMPLATES / "think_opened_chat_template.jinja"
    yield from client_on_template(tmp_path_factory, chat_model, store, template)


def whole_and_streamed(client, model: str, regex: str | None, **more) -> list[tuple[str | None, str]]:
    """(reasoning_content, content) of the reply written to `regex` (None: a seeded draw of 8
    tokens), whole, then streamed; `more`: the request's other parameters."""
    ask = dict(model=model, messages=MESSAGES, max_tokens=40)
    if regex is None:
        ask |= dict(max_tokens=8, temperature=1.0, seed=5)
    else:
        ask["extra_body"] = {"structured_outputs": {"regex": regex}}
    ask |= more
    message = client.chat.completions.create(**ask).choices[0].message
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(**ask, stream=True)]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return [(message.reasoning_content, message.content), (streamed or None, content)]


def test_a_block_the_reply_opens_is_reasoning_content(think_client):
    client, model = think_client
    written = r"<think>\nSky: [a-z]{4}\.\n</think>\n\nBlue"
    for reasoning, content in whole_and_streamed(client, model, written):
        assert reasoning.startswith("\nSky: ") and reasoning.endswith(".\n")
        assert content == "Blue"


def test_a_reply_without_a_block_is_all_content(think_client):
    client, model = think_client
    for reasoning, content in whole_and_streamed(client, model, r"Blue, [a-z]{4}"):
        assert reasoning is None and content.startswith("Blue, ")


def test_a_block_the_prompt_opened_is_reasoning_until_it_closes(opened_client):
    """Eight tokens drawn after the prompt opened the block, none of them closing it: all
    reasoning, the same whole and streamed."""
    client, model = opened_client
    whole, streamed = whole_and_streamed(client, model, None)
    assert whole == streamed and whole[0] and whole[1] == ""


@pytest.mark.parametrize(
    "constraint",
    [
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"structured_outputs": {"regex": r"Blue, [a-z]{4}"}}},
        {"tools": [WEATHER], "tool_choice": "required"},
    ],
    ids=["response_format", "structured_outputs", "tool_choice"],
)
def test_a_constrained_reply_reasons_freely_before_the_answer_it_holds(opened_client, constraint):
    """The constraint holds what follows the block the prompt opened: the model's first greedy
    tokens are those it writes unconstrained, and they are reasoning (the block does not close
    within them, so no answer yet), whole and streamed."""
    client, model = opened_client
    free = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    reasoning = free.choices[0].message.reasoning_content
    assert reasoning and "</think>" not in reasoning
    replies = whole_and_streamed(client, model, None, max_tokens=8, temperature=0, **constraint)
    assert replies == [(reasoning, "")] * 2


@pytest.mark.parametrize(
    "regex, expected",
    [
        (r"<think>Sky: blue </th", ("Sky: blue </th", "")),  # a closing tag's start, then the end
        (r"<think>Sky: blue", ("Sky: blue", "")),
    ],
)
def test_what_is_held_back_at_a_replys_end_goes_out_in_its_last_chunk(think_client, regex, expected):
    client, model = think_client
    for reasoning, content in whole_and_streamed(client, model, regex):
        assert (reasoning, content) == expected


def test_a_reply_of_a_tags_start_alone_is_content(think_client):
    client, model = think_client
    assert whole_and_streamed(client, model, "<thi") == [(None, "<thi")] * 2


def test_chat_template_kwargs_turn_thinking_off_as_qwen3s_template_does(think_client):
    """vLLM's chat_template_kwargs: with enable_thinking false the prompt closes an empty block,
    so the reply is all content; a variable the worker sets is a 400 naming it."""
    client, model = think_client
    ask = dict(
        model=model, messages=MESSAGES, max_tokens=4, extra_body={"structured_outputs": {"regex": "Blue"}}
    )
    thinking = client.chat.completions.create(**ask)
    off = {"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "Blue"}}
    answered = client.chat.completions.create(**(ask | {"extra_body": off}))
    assert answered.usage.prompt_tokens > thinking.usage.prompt_tokens  # the empty block <think>\n\n</think>
    assert (
        answered.choices[0].message.content == "Blue"
        and answered.choices[0].message.reasoning_content is None
    )
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**(ask | {"extra_body": {"chat_template_kwargs": {"messages": []}}}))
    assert "variable 'messages' is set by the worker" in raised.value.body["message"]


def test_an_answer_sent_back_with_its_reasoning_renders_it(think_client):
    """The openai client sends back the assistant message it got, reasoning_content included:
    taken, and given to the template, which renders it (as Qwen3's does within a tool-using turn)."""
    client, model = think_client
    written = {"structured_outputs": {"regex": r"<think>\nSky: blue\.\n</think>\n\nBlue"}}
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, extra_body=written)
    answer = first.choices[0].message
    assert answer.reasoning_content == "\nSky: blue.\n"
    bare = {"role": "assistant", "content": answer.content}
    usage = {}
    for name, sent in (("with", answer), ("without", bare)):
        messages = [*MESSAGES, sent, {"role": "user", "content": "And at night?"}]
        usage[name] = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
    assert usage["with"].prompt_tokens > usage["without"].prompt_tokens  # the reasoning was rendered


def test_a_continued_answer_is_content_though_the_template_reasons(opened_client):
    """The prompt continues the answer begun for the model and opens no block: the reply is
    content, and its constraint holds it from its first token."""
    client, model = opened_client
    begun = [*MESSAGES, {"role": "assistant", "content": "Blue"}]
    for reasoning, content in whole_and_streamed(
        client,
        model,
        r", [a-z]{4}",
        messages=begun,
        extra_body={"structured_outputs": {"regex": r", [a-z]{4}"}, "continue_final_message": True},
    ):
        assert reasoning is None and re.fullmatch(r", [a-z]{4}", content)
