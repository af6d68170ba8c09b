"""A thinking model's <think> block read out of a chat choice's text (openai_gateway/reasoning.py):
whatever pieces a stream brings the text in, the reasoning and content sent add up to what the
whole text gives; space around the tags is neither; a tag split across pieces is found."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loramux import ModelInfo
from openai_gateway.completions import reasoning_reader
from openai_gateway.protocol import ChatCompletionRequest
from openai_gateway.reasoning import Reasoning

# (opened by the prompt, the reply, its reasoning, its content)
REPLIES = {
    "a block, then the answer": (False, "<think>\nSky: blue.\n</think>\n\nBlue.", "\nSky: blue.\n", "Blue."),
    "space before the block": (False, "\n <think>a</think>b", "a", "b"),
    "no block": (False, "Blue, <think> is a tag.", "", "Blue, <think> is a tag."),
    "space, then no block": (False, "\n\nBlue.", "", "\n\nBlue."),
    "only a tag's start": (False, "<thi", "", "<thi"),
    "space and a tag's start": (False, "\n <thi", "", "\n <thi"),
    "an unclosed block": (False, "<think>still thinking", "still thinking", ""),
    "an empty block": (False, "<think>\n\n</think>\n\nBlue.", "\n\n", "Blue."),
    "opened by the prompt": (True, "Sky: blue.\n</think>\n\nBlue.", "Sky: blue.\n", "Blue."),
    "opened, never closed": (True, "thinking <thin", "thinking <thin", ""),
    "opened, a false close": (True, "a </thinking> b</think>c", "a </thinking> b", "c"),
    "opened, only space after": (True, "a</think>\n\n", "a", ""),
}


def _read(opened: bool, text: str, cuts: list[int]) -> tuple[str, str]:
    reasoning = Reasoning(opened)
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    pieces = [reasoning.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [reasoning.end()]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


@pytest.mark.parametrize("case", list(REPLIES))
@given(cuts=st.lists(st.integers(0, 100), max_size=10))
def test_a_reply_is_reasoning_then_content_in_any_pieces(case, cuts):
    opened, text, reasoning, content = REPLIES[case]
    assert _read(opened, text, []) == (reasoning, content)
    assert _read(opened, text, cuts) == (reasoning, content)


def test_reasoning_streams_as_it_comes_and_a_closing_tag_is_held_until_known():
    reasoning = Reasoning(opened=False)
    assert reasoning.feed("<thi") == ("", "")
    assert reasoning.feed("nk>Sky is") == ("Sky is", "")
    assert reasoning.feed(" blue</th") == (" blue", "")
    assert reasoning.feed("ink>\n") == ("", "")
    assert reasoning.feed("Blue") == ("", "Blue")
    assert reasoning.end() == ("", "")


def info(reasoning_format: str, constrains_reasoning: bool) -> ModelInfo:
    return ModelInfo(
        "m", "llama", 8, 8, "float32", "cpu", 1, 8, 1, [2], True,
        reasoning_format=reasoning_format, constrains_reasoning=constrains_reasoning,
    )  # fmt: skip


@pytest.mark.parametrize(
    "reasoning_format, constrains_reasoning, constrained, opened",
    [
        ("think_opened", False, True, True),  # the worker holds the constraint after the block
        ("think_opened", True, True, False),  # the constraint held the reply from its first token
        ("think_opened", True, False, True),
        ("think", True, True, False),
        ("think", False, False, False),
    ],
)
def test_a_reply_is_read_as_the_worker_holds_its_constraint(
    reasoning_format, constrains_reasoning, constrained, opened
):
    extra = {"response_format": {"type": "json_object"}} if constrained else {}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Sky?"}], **extra)
    reader = reasoning_reader(info(reasoning_format, constrains_reasoning), body)()
    assert reader.feed("Sky: blue.</think>Blue.") == (
        ("Sky: blue.", "Blue.") if opened else ("", "Sky: blue.</think>Blue.")
    )


def test_a_template_without_a_block_has_no_reader():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Sky?"}])
    assert reasoning_reader(info("", False), body) is None


@pytest.mark.parametrize("extra", [{"continue_final_message": True}, {"add_generation_prompt": False}])
def test_a_reply_to_a_prompt_that_opens_none_is_all_content(extra):
    messages = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue"}]
    body = ChatCompletionRequest(model="m", messages=messages, **extra)
    reader = reasoning_reader(info("think_opened", False), body)()
    assert reader.feed("<think>a</think>b") == ("", "<think>a</think>b") and reader.end() == ("", "")
