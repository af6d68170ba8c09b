"""Streaming text deltas on the default model's byte-level BPE tokenizer: what a client reads."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_service.engine.detokenizer import IncrementalDetokenizer
from inference_service.engine.tokenizer import Tokenizer
from shared.errors import InvalidArgument

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " Leading space, then more words.",
    'def add(x, y):\n    """Sum."""\n    return x + y  # 1 line\n',
    "🚀🎉 launch party 🚀",
    "日本語のテキスト",
    "café naïve résumé",
    "Order 66 costs $1,234.56 (x3 = 3703.68)",
    "mixed: 日本 🚀 café 42\n\tend",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    return tokenizer.encode(prompt, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Every push() delta, then finish()'s, as a client would receive them."""
    return [detok.push(i) for i in token_ids] + [detok.finish()]


def generated(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("with_prompt", [True, False], ids=["prompt", "no-prompt"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_decode_and_never_split_a_character(tokenizer, prompt_ids, text, with_prompt):
    ids = generated(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids if with_prompt else [])
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert all(d.encode("utf-8").decode("utf-8") == d for d in deltas)
    assert not detok.stopped


def test_partial_character_tokens_yield_nothing_until_complete(tokenizer, prompt_ids):
    rocket = generated(tokenizer, "🚀")
    party = generated(tokenizer, "🎉")
    assert len(rocket) > 1 and len(party) > 1  # each emoji is several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert [detok.push(i) for i in rocket] == [""] * (len(rocket) - 1) + ["🚀"]
    assert [detok.push(i) for i in party] == [""] * (len(party) - 1) + ["🎉"]
    assert detok.finish() == ""


def test_unfinished_character_at_the_end_comes_out_as_decode_gives_it(tokenizer, prompt_ids):
    ids = generated(tokenizer, "ok 🚀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == "ok \ufffd"
    assert "\ufffd" not in "".join(deltas[:-1])  # only finish() gives the unfinished character


def test_first_token_keeps_its_leading_space(tokenizer, prompt_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert detok.push(generated(tokenizer, " Hello")[0]) == " Hello"


def test_decode_window_stays_short_on_long_outputs(tokenizer, prompt_ids, default_model_dir):
    longest = []

    class Recording(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=False):
            longest.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    recording = Recording.from_dir(default_model_dir)
    ids = generated(tokenizer, " ".join(TEXTS) * 40)
    assert "".join(stream(IncrementalDetokenizer(recording, prompt_ids), ids)) == tokenizer.decode(ids)
    assert len(ids) > 2000 and max(longest) <= 16


def stop_case(tokenizer, text, stop):
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    return detok, "".join(stream(detok, generated(tokenizer, text)))


def test_single_token_stop(tokenizer):
    assert len(generated(tokenizer, "###")) == 1
    detok, out = stop_case(tokenizer, "Hello### world", ("###",))
    assert out == "Hello"
    assert detok.stopped and detok.stop_string == "###"


def test_multi_token_stop(tokenizer):
    detok, out = stop_case(tokenizer, "Answer: 42. STOP HERE and more", ("STOP HERE",))
    assert len(generated(tokenizer, " STOP HERE")) > 1
    assert out == "Answer: 42. "
    assert detok.stop_string == "STOP HERE"


def test_an_included_stop_string_ends_the_text_and_nothing_follows(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("lo wo",), include_stop=True)
    assert "".join(stream(detok, generated(tokenizer, "Hello world, and more"))) == "Hello wo"


def test_stop_spanning_a_token_boundary(tokenizer):
    detok, out = stop_case(tokenizer, "Hello world", ("lo wo",))
    assert out == "Hel"
    assert detok.stop_string == "lo wo"


def test_stop_at_the_very_start(tokenizer):
    detok, out = stop_case(tokenizer, "###rest of it", ("###",))
    assert out == ""
    assert detok.stopped


def test_stop_is_never_emitted_even_in_pieces(tokenizer):
    ids = generated(tokenizer, "a ST")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    assert "".join(detok.push(i) for i in ids) == "a "  # "ST" may start "STOP": held
    assert "".join(detok.push(i) for i in generated(tokenizer, "OP")) == ""
    assert detok.stop_string == "STOP"


def test_partial_match_is_released_when_it_diverges(tokenizer):
    ids = generated(tokenizer, "##x")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("###",))
    assert [detok.push(i) for i in ids] == ["", "##x"]
    assert detok.finish() == ""
    assert not detok.stopped and detok.stop_string is None


def test_partial_match_is_released_at_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("###",))
    deltas = stream(detok, generated(tokenizer, "Hello ##"))
    assert deltas[-1] == "##" and "".join(deltas) == "Hello ##"
    assert not detok.stopped


def test_earliest_stop_wins(tokenizer):
    detok, out = stop_case(tokenizer, "a STOP b END c", ("END", "STOP"))
    assert out == "a "
    assert detok.stop_string == "STOP"


def test_overlapping_stops_cut_the_same_whatever_the_token_split(tokenizer):
    text, stop = "xabcx", ("abc", "b")
    merged = generated(tokenizer, text)
    per_char = [t for ch in text for t in generated(tokenizer, ch)]
    assert len(merged) < len(per_char) == len(text)
    for ids in (merged, per_char):
        detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
        assert "".join(stream(detok, ids)) == "xa"
        assert detok.stop_string == "b"


def test_nothing_after_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("###",))
    assert "".join(detok.push(i) for i in generated(tokenizer, "Hi###")) == "Hi"
    assert all(detok.push(i) == "" for i in generated(tokenizer, " more text"))
    assert detok.finish() == ""


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(InvalidArgument):
        IncrementalDetokenizer(tokenizer, [], stop=("",))


@pytest.mark.parametrize(
    "skip, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")], ids=["skip", "keep"]
)
def test_special_tokens(tokenizer, prompt_ids, skip, expected):
    ids = generated(tokenizer, "Hi there<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == expected == tokenizer.decode(ids, skip_special_tokens=skip)


def cut_at_first_stop(text: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """The reference: search the whole text at once for the stop string that ends first."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    end, _, s = min(hits)
    return text[: end - len(s)], s


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab \n", max_size=40),
    stop=st.lists(st.text(alphabet="ab \n", min_size=1, max_size=6), max_size=4),
    per_char=st.booleans(),
    include=st.booleans(),
)
def test_stop_cut_is_the_whole_text_search_whatever_the_pieces(tokenizer, text, stop, per_char, include):
    """With include_stop (vLLM's include_stop_str_in_output) the cut comes after the stop string."""
    ids = [t for ch in text for t in generated(tokenizer, ch)] if per_char else generated(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=tuple(stop), include_stop=include)
    expected, stop_string = cut_at_first_stop(tokenizer.decode(ids), tuple(stop))
    assert "".join(stream(detok, ids)) == expected + (stop_string or "" if include else "")
    assert detok.stop_string == stop_string


def test_text_is_held_back_no_longer_than_a_stop_string_could_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("a" * 8 + "b",))
    ids = [t for _ in range(50) for t in generated(tokenizer, "a")]
    assert "".join(detok.push(i) for i in ids) == "a" * 42
    assert detok.finish() == "a" * 8


@pytest.mark.parametrize("min_tokens, out", [(0, "a"), (4, "a"), (5, "a###b"), (9, "a###b###c")])
def test_a_stop_string_before_min_tokens_does_not_end_the_text(tokenizer, min_tokens, out):
    """One token a character: the first ### arrives with the 4th token, the second with the 8th."""
    ids = [t for ch in "a###b###c" for t in generated(tokenizer, ch)]
    assert len(ids) == 9
    detok = IncrementalDetokenizer(tokenizer, [], stop=("###",), min_tokens=min_tokens)
    assert "".join(stream(detok, ids)) == out and detok.stopped == (min_tokens < 9)


def test_the_search_goes_on_past_a_stop_before_min_tokens_within_one_token(tokenizer):
    """One token writes "abc": its "ab" comes before min_tokens and is passed over, and the "c"
    after it starts "cd", which the next token's "d" ends."""
    ids = generated(tokenizer, "abc") + generated(tokenizer, "d")
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tokenizer, [], stop=("ab", "cd"), min_tokens=2)
    assert "".join(stream(detok, ids)) == "ab" and detok.stop_string == "cd"


def cut_at_first_stop_from(text: str, stop: tuple[str, ...], first_end: int) -> str:
    """The reference: the stop string that ends first at or past `first_end`, every occurrence
    searched in the whole text, the longer on a tie; the text before it."""
    hits = [
        (i + len(s), -len(s), s)
        for s in stop
        for i in range(len(text) - len(s) + 1)
        if text.startswith(s, i) and i + len(s) >= first_end
    ]
    return text[: min(hits)[0] - len(min(hits)[2])] if hits else text


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab \n", max_size=40),
    stop=st.lists(st.text(alphabet="ab \n", min_size=1, max_size=6), max_size=4),
    min_tokens=st.integers(0, 40),
)
def test_stops_that_end_before_min_tokens_are_passed_over_whatever_the_text(
    tokenizer, text, stop, min_tokens
):
    """One token a character, so the text's n-th character arrives with the n-th token."""
    ids = [t for ch in text for t in generated(tokenizer, ch)]
    detok = IncrementalDetokenizer(tokenizer, [], stop=tuple(stop), min_tokens=min_tokens)
    assert "".join(stream(detok, ids)) == cut_at_first_stop_from(
        tokenizer.decode(ids), tuple(stop), min_tokens
    )
