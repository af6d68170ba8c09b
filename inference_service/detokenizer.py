"""Generated token ids -> text deltas for one streaming request, with stop strings.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character, and a decoder may treat a
token's leading space differently at the start of a text. So each step decodes a short window of
recent tokens (from `prefix` on) and emits only what the new tokens add past the `read` mark, and
only once the window's text no longer ends in U+FFFD (an unfinished character), as vLLM and TGI do.
"""

from inference_service.tokenizer import Tokenizer
from shared.errors import InvalidArgument

# Prompt tokens the first window starts with: enough context that the first generated token
# decodes (leading space included) as it does inside the whole text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, released delta by delta; stop strings cut it and are never released.

    Concatenating every push() delta and finish() gives `tokenizer.decode(generated_ids)`, cut just
    before the first stop string (the one whose last character comes first in the text).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ):
        if any(not s for s in stop):
            raise InvalidArgument("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)  # window[:read] is already released (or prompt)
        self._read_text = self._decode(self._window)
        self._held = ""  # decoded text that may be the start of a stop string
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
        """The part of held + new text known to be output; keeps back a possible stop-string start."""
        text = self._held + new_text
        cut = _first_stop(text, self._stop)
        if cut is not None:
            start, self._stop_string = cut
            self._held = ""
            return text[:start]
        keep = _open_stop_prefix(text, self._stop)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence that ends first, the longer one on a tie; else None.

    Ending first, not starting first, makes the cut the same whatever way the text arrives in pieces.
    """
    found = [(text.find(s), s) for s in stop]
    hits = [(start + len(s), start, s) for start, s in found if start >= 0]
    if not hits:
        return None
    _, start, s = min(hits)
    return start, s


def _open_stop_prefix(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
