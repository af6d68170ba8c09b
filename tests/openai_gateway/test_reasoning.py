"""A thinking model's <think> block read out of a chat choice's text (openai_gateway/reasoning.py):
whatever pieces a stream brings the text in, the reasoning and content sent add up to what the
whole text gives; space around the tags is neither; a tag split across pieces is found."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
