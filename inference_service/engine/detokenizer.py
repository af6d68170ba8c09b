"""Generated token ids -> text deltas for one streaming request, with stop strings.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character, and a decoder may treat a
token's leading space differently at the start of a text. So each step decodes a short window of
recent tokens (from `prefix` on) and emits only what the new tokens add past the `read` mark, and
only once the window's text no longer ends in U+FFFD (an unfinished character), as vLLM and TGI do.
"""

from inference_service.engine.tokenizer import Tokenizer
from shared.errors import InvalidArgument

# Prompt tokens the first window starts with: enough context that the first generated token
# decodes (leading space included) as it does inside the whole text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, released delta by delta; stop strings cut it, and are released
    only where `include_stop` says so (vLLM's include_stop_str_in_output).

    Concatenating every push() delta and finish() gives `tokenizer.decode(generated_ids)`, cut just
    before the first stop string (the one whose last character comes first in the text), or just
    after it with `include_stop`. A stop string whose text arrives before the output holds
    `min_tokens` tokens does not end it (as vLLM's stop checks wait for min_tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ):
        if any(not s for s in stop):
            raise InvalidArgument("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens, self._include_stop = skip_special_tokens, include_stop
        self._min_tokens, self._pushed = min_tokens, 0  # tokens pushed so far
        self._stop = _StopMatcher(tuple(stop))
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)  # window[:read] is already released (or prompt)
        self._read_text = self._decode(self._window)
        self._held = ""  # decoded text that may start a stop string: shorter than the longest one
        self._stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_string

    def push(self, token_id: int) -> str:
        """The text that generating `token_id` makes final; "" while a character or stop match is open."""
        if self.stopped:
            return ""
        self._pushed += 1
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._read_text):
            return ""
        return self._release(self._advance(text))

    def finish(self) -> str:
        """The text still held back at the end of generation, an unfinished character as decode gives it."""
        if self.stopped:
            return ""
        text = self._decode(self._window)
        released = self._release(self._advance(text)) if len(text) > len(self._read_text) else ""
        tail, self._held = self._held, ""
        return released + tail

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, text: str) -> str:
        """Marks the whole window read; its text past the old read mark is the new text."""
        new_text = text[len(self._read_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return new_text

    def _release(self, new_text: str) -> str:
        """The part of held + new text known to be output; keeps back a possible stop-string start.
        Costs O(held + new text): a stop string that ends here started within them."""
        text = self._held + new_text
        cut = self._first_stop(new_text)
        if cut is not None:
            end, self._stop_string = cut
            end += len(self._held)  # in text
            self._held = ""
            return text[: end if self._include_stop else end - len(self._stop_string)]
        keep = self._stop.open
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _first_stop(self, new_text: str) -> tuple[int, str] | None:
        """(end in new_text, s) of the first stop string s ending in it that may end the output;
        before the output holds min_tokens tokens, none may, and the search goes on past each."""
        at = 0
        while (cut := self._stop.feed(new_text[at:])) is not None:
            if self._pushed >= self._min_tokens:
                return at + cut[0], cut[1]
            at += cut[0]
        return None


class _StopMatcher:
    """Finds stop strings in a text fed piece by piece, as Knuth-Morris-Pratt finds one pattern: per
    stop string it keeps how many of its first characters end the text so far, so a new character
    costs O(1) amortized per stop string, however long the text before it."""

    def __init__(self, stop: tuple[str, ...]):
        self._stop = stop
        self._fallback = [_prefix_function(s) for s in stop]
        self._matched = [0] * len(stop)  # stop[k][:matched[k]] ends the text so far
        self._chars = frozenset("".join(stop))

    @property
    def open(self) -> int:
        """Length of the longest end of the text so far that is a proper start of a stop string."""
        return max(self._matched, default=0)

    def feed(self, text: str) -> tuple[int, str] | None:
        """(end, s): stop string s is the first to end in `text`, at text[:end], the longer one on a
        tie; None when none ends in it. Ending first, not starting first, makes the cut the same
        whatever way the text arrives in pieces."""
        if not self._stop:
            return None
        for i, ch in enumerate(text):
            if ch not in self._chars:  # in no stop string: no start of one stays open
                self._matched = [0] * len(self._stop)
                continue
            ended = [s for k, s in enumerate(self._stop) if self._advance(k, ch)]
            if ended:
                return i + 1, max(ended, key=len)
        return None

    def _advance(self, k: int, ch: str) -> bool:
        """Extends stop string k's match by `ch`; True when the whole string just matched."""
        s, fallback, n = self._stop[k], self._fallback[k], self._matched[k]
        while n and s[n] != ch:
            n = fallback[n - 1]
        if s[n] == ch:
            n += 1
        self._matched[k] = fallback[n - 1] if n == len(s) else n
        return n == len(s)


def _prefix_function(s: str) -> list[int]:
    """fallback[i]: the length of the longest proper start of s[: i + 1] that also ends it."""
    fallback = [0] * len(s)
    for i in range(1, len(s)):
        n = fallback[i - 1]
        while n and s[i] != s[n]:
            n = fallback[n - 1]
        fallback[i] = n + 1 if s[i] == s[n] else n
    return fallback
