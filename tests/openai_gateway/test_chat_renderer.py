"""A chat choice's reasoning and tool calls read together (openai_gateway/renderer.py): a thinking
model's block goes out as `reasoning_content`, and only the text after it is read for calls, so a
tag the model thinks about is not a call; whole and streamed alike."""

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from loramux import Completion, Delta
from openai_gateway.reasoning import Reasoning
from openai_gateway.renderer import ChatRenderer
from openai_gateway.samples import Usage
from openai_gateway.tool_calls import HermesCalls

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
REPLY = f"<think>\nShould I write <tool_call>? Yes.\n</think>\n\nSure.\n{CALL}"


def renderer() -> ChatRenderer:
    return ChatRenderer("m", None, False, tool_parser=HermesCalls, reasoning=lambda: Reasoning(opened=False))


def completion(text: str) -> Completion:
    return Completion(text, [], "stop", 1, 1, 0.0, 0.0)


def test_a_whole_reply_is_reasoning_content_and_calls_of_its_answer():
    body = renderer().whole([completion(REPLY)], Usage(1, 1, 0))
    [choice] = body["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "\nShould I write <tool_call>? Yes.\n"
    assert message["content"] == "Sure.\n" and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"x": 1}


@given(cuts=st.lists(st.integers(0, len(REPLY)), max_size=10))
def test_a_streamed_reply_adds_up_to_the_whole_in_any_pieces(cuts):
    streaming = renderer()
    bounds = [0, *sorted(set(cuts)), len(REPLY)]
    chunks = [streaming.chunk(0, Delta([], REPLY[a:b], [])) for a, b in itertools.pairwise(bounds)]
    chunks.append(streaming.chunk(0, completion(REPLY)))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nShould I write <tool_call>? Yes.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Sure.\n"
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["f"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
