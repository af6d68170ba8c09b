"""Reasoning: a thinking model's <think>...</think> block read out of a chat choice's text, sent as
`reasoning_content` (as vLLM's reasoning parsers and DeepSeek's API send it), the rest as content.

Two forms, which the worker's ModelInfo.reasoning_format names from the chat template: "think",
where the model opens the block itself (Qwen3), so a reply that does not open with <think> is all
content; and "think_opened", where the generation prompt has opened it (DeepSeek-R1, Qwen3's
thinking models), so the reply is reasoning until </think>. The worker holds a request's own
constraint (a response format, structured outputs, a forced tool choice) after the block. A
worker that holds the block to it too (ModelInfo.constrains_reasoning) leaves a reply it holds from
the first token (constraints.constrains_from_the_start) no room to reason: there a reply is read as
under "think", so the answer the constraint shaped is content. Space around the tags is not content.
Each search starts where the last ended, and a tag split across pieces is held until it is known.
"""

import enum

from .tool_calls import tag_start

OPEN, CLOSE = "<think>", "</think>"


class _State(enum.Enum):
    OPENING = "opening"  # the reply may yet open with <think>: space and a tag's start are held
    REASONING = "reasoning"  # inside the block: a start of </think> is held
    CLOSED = "closed"  # after </think>: space is dropped until the content starts
    CONTENT = "content"


class Reasoning:
    def __init__(self, opened: bool):
        self._state = _State.REASONING if opened else _State.OPENING
        self._space = ""  # while opening: the reply's space so far
        self._held = ""  # a start of the tag looked for next; before content, its space

    @classmethod
    def all_content(cls) -> "Reasoning":
        """The reader of a reply that holds no block (one that continues the final message): all
        of it is content, and the message still carries `reasoning_content` (null)."""
        reader = cls(opened=False)
        reader._state = _State.CONTENT
        return reader

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) the next piece of the text adds."""
        if self._state is _State.OPENING:
            return self._opening(text)
        if self._state is _State.REASONING:
            return self._reasoning(text)
        if self._state is _State.CLOSED:
            return "", self._closed(text)
        return "", text

    def end(self) -> tuple[str, str]:
        """What was held back, once the text is whole: an unclosed block is all reasoning."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return held, ""
        return "", self._space + held if self._state is _State.OPENING else ""

    def _opening(self, text: str) -> tuple[str, str]:
        if not self._held:  # space before the first other character is held, and dropped before <think>
            stripped = text.lstrip()
            self._space += text[: len(text) - len(stripped)]
            text = stripped
        opening = self._held + text
        if opening.startswith(OPEN):
            self._state, self._space, self._held = _State.REASONING, "", ""
            return self._reasoning(opening[len(OPEN) :])
        if OPEN.startswith(opening):  # nothing but the tag's start so far
            self._held = opening
            return "", ""
        self._state, content, self._space, self._held = _State.CONTENT, self._space + opening, "", ""
        return "", content

    def _reasoning(self, text: str) -> tuple[str, str]:
        held = self._held + text  # the held part is shorter than </think>: searching it is cheap
        at = held.find(CLOSE)
        if at < 0:
            kept = len(held) - tag_start(held, CLOSE)
            self._held = held[kept:]
            return held[:kept], ""
        self._state, self._held = _State.CLOSED, ""
        return held[:at], self._closed(held[at + len(CLOSE) :])

    def _closed(self, text: str) -> str:
        """Space after the block is not content."""
        content = text.lstrip()
        if content:
            self._state = _State.CONTENT
        return content
