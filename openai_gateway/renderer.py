"""Renderer: one request's choices as OpenAI's JSON, whole or as stream chunks, for chat
(`chat.completion`) and legacy text (`text_completion`) completions.

The two differ only in how a choice's text and logprobs are wrapped; the stream keeps, per choice,
what its next chunk needs (chat's role goes in the first chunk; text offsets run on).
"""

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable

from loramux import Completion, Delta

from . import logprobs as lp
from .reasoning import Reasoning
from .samples import Event, Usage
from .tool_calls import Parsed, ToolCallParser, whole_calls


class Renderer(ABC):
    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, alternatives: int | None, include_usage: bool):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._alternatives = alternatives  # None: no logprobs asked for
        self._include_usage = include_usage
        self._sent: dict[int, int] = {}  # choice index -> characters of text sent

    def whole(self, completions: list[Completion], usage: Usage) -> dict:
        choices = [self._whole_choice(i, c) for i, c in enumerate(completions)]
        return self._envelope(self.object, choices) | {"usage": usage.body()}

    def chunk(self, index: int, event: Event) -> dict:
        if isinstance(event, Completion):
            choice = self._last_choice(index, event)
        else:
            choice = self._delta_choice(index, event)
            self._sent[index] = self._sent.get(index, 0) + len(event.text)
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(self.chunk_object, []) | {"usage": usage.body()}

    def _chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.chunk_object, choices)
        return body | {"usage": None} if self._include_usage else body

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    @abstractmethod
    def _whole_choice(self, index: int, completion: Completion) -> dict:
        """A choice of the whole response."""

    @abstractmethod
    def _delta_choice(self, index: int, delta: Delta) -> dict:
        """A stream chunk's choice carrying new text."""

    @abstractmethod
    def _last_choice(self, index: int, completion: Completion) -> dict:
        """A stream chunk's choice carrying the finish reason."""


class ChatRenderer(Renderer):
    """With a reasoning format, each choice's <think> block goes out as `reasoning_content`
    (reasoning.py). With a tool call parser, the rest of its text is read for calls
    (tool_calls.py): they go out as `tool_calls`, and a choice that called a tool and stopped ends
    with finish_reason "tool_calls"."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        *args,
        tool_parser: Callable[[], ToolCallParser] | None = None,
        reasoning: Callable[[], Reasoning] | None = None,
    ):
        super().__init__(*args)
        self._tool_parser = tool_parser
        self._reasoning = reasoning
        self._parsers: dict[int, ToolCallParser] = {}  # choice index -> its stream's parser
        self._splitters: dict[int, Reasoning] = {}  # choice index -> its stream's reasoning reader

    def _whole_choice(self, index: int, completion: Completion) -> dict:
        thought, text = "", completion.text
        if self._reasoning is not None:
            splitter = self._reasoning()
            thought, text = _joined(splitter.feed(text), splitter.end())
        message = {"role": "assistant", "content": text}
        finish = completion.finish_reason
        if self._tool_parser is not None:
            parser = self._tool_parser()
            parsed = parser.feed(text) + parser.end()
            message, finish = _message(parsed), _finish(finish, parser)
        if self._reasoning is not None:
            message["reasoning_content"] = thought or None
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(completion.logprobs),
            "finish_reason": finish,
        }

    def _delta_choice(self, index: int, delta: Delta) -> dict:
        thought, text = self._splitter(index).feed(delta.text) if self._reasoning else ("", delta.text)
        content = {"content": text} if text or not thought else {}
        if self._tool_parser is not None:
            content = _delta(self._parser(index).feed(text))
        if thought:
            content = {"reasoning_content": thought} | content
        if index not in self._sent:  # a choice's first chunk names the role, as OpenAI's do
            content = {"role": "assistant"} | content
        return {
            "index": index,
            "delta": content,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": None,
        }

    def _last_choice(self, index: int, completion: Completion) -> dict:
        start = {} if index in self._sent else {"role": "assistant", "content": ""}
        finish = completion.finish_reason
        thought, text = self._splitter(index).end() if self._reasoning else ("", "")
        if thought:
            start["reasoning_content"] = thought
        if self._tool_parser is not None:  # what the parsers held back, and whether it found calls
            parser = self._parser(index)
            parsed = parser.feed(text) + parser.end()
            start, finish = start | _delta(parsed), _finish(finish, parser)
        elif text:
            start["content"] = text
        return {"index": index, "delta": start, "logprobs": None, "finish_reason": finish}

    def _parser(self, index: int) -> ToolCallParser:
        if index not in self._parsers:
            self._parsers[index] = self._tool_parser()
        return self._parsers[index]

    def _splitter(self, index: int) -> Reasoning:
        if index not in self._splitters:
            self._splitters[index] = self._reasoning()
        return self._splitters[index]

    def _logprobs(self, entries) -> dict | None:
        return None if self._alternatives is None else lp.chat(entries, self._alternatives)


def _message(parsed: Parsed) -> dict:
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}
    calls = whole_calls(parsed.calls)
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


def _delta(parsed: Parsed) -> dict:
    delta = {"content": parsed.content} if parsed.content else {}
    if parsed.calls:
        delta["tool_calls"] = [part.body() for part in parsed.calls]
    return delta


def _joined(*pieces: tuple[str, str]) -> tuple[str, str]:
    """(reasoning, content) of consecutive pieces."""
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


def _finish(reason: str, parser: ToolCallParser) -> str:
    """A choice that called a tool and ended on its own ends for "tool_calls"."""
    return "tool_calls" if parser.calls and reason == "stop" else reason


class TextRenderer(Renderer):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def _whole_choice(self, index: int, completion: Completion) -> dict:
        return {
            "index": index,
            "text": completion.text,
            "logprobs": self._logprobs(completion.logprobs, 0),
            "finish_reason": completion.finish_reason,
        }

    def _delta_choice(self, index: int, delta: Delta) -> dict:
        logprobs = self._logprobs(delta.logprobs, self._sent.get(index, 0))
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}

    def _last_choice(self, index: int, completion: Completion) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": completion.finish_reason}

    def _logprobs(self, entries, offset: int) -> dict | None:
        return None if self._alternatives is None else lp.text(entries, self._alternatives, offset)
