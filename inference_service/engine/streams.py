"""Streams: every request submitted and not yet finished, with the sink its deltas go to.

Deltas are built here and nowhere else. A submit opens a stream from any thread; the stepping
thread emits tokens and closes streams; a dead engine closes them all from whichever thread saw
it die, without the step lock (a step that hangs may hold it for good).
"""

import threading
from dataclasses import dataclass

from inference_service.engine.detokenizer import IncrementalDetokenizer
from inference_service.engine.request import Delta, Sink
from inference_service.engine.sampler import TokenLogprobs
from inference_service.engine.sequence import Sequence
from inference_service.engine.tokenizer import Tokenizer
from shared.errors import InvalidArgument, LoramuxError, Unavailable


@dataclass(eq=False)
class _Stream:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None when the model folder has no tokenizer
    sink: Sink


class Streams:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...]):
        self._tokenizer, self._eos_token_ids = tokenizer, eos_token_ids
        self._open: dict[str, _Stream] = {}  # by request id
        self._lock = threading.Lock()
        self._closed_by: Unavailable | None = None  # set once every stream was ended for good

    def open(self, seq: Sequence, sink: Sink) -> None:
        """Start the stream of a new sequence; refused once the engine is dead, and for a request
        id already in flight."""
        detokenizer = None
        if self._tokenizer is not None:
            params = seq.params
            detokenizer = IncrementalDetokenizer(
                self._tokenizer,
                seq.prompt_token_ids,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
        with self._lock:  # a submit either lands before the engine dies or sees it dead
            if self._closed_by is not None:
                raise self._closed_by
            if seq.request_id in self._open:
                raise InvalidArgument(f"request id {seq.request_id!r} is already in flight")
            self._open[seq.request_id] = _Stream(seq, detokenizer, sink)

    def emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Send the delta of a token just added to the sequence's output; returns the finish
        reason that token brings ("stop", "length"), or None while the request goes on."""
        # Under the lock: close_all (the watchdog's, while an overrunning step goes on) either
        # ends the stream before this delta or after it, never between the lookup and the send.
        with self._lock:
            stream = self._open.get(seq.request_id)
            if stream is None:  # ended by close_all while the step ran
                return None
            text = stream.detokenizer.push(token) if stream.detokenizer else ""
            stream.sink(Delta(seq.request_id, [token], text, [logprobs] if logprobs else []))
        return self._finish_reason(stream, token)

    def close(self, seq: Sequence, error: LoramuxError | None = None) -> None:
        """Send the last delta of a sequence the scheduler has finished: its finish reason, usage,
        any text the detokenizer still held back, and the error that ended it."""
        with self._lock:
            stream = self._open.pop(seq.request_id, None)
        if stream is None:
            return
        reason = seq.finish_reason
        tail = stream.detokenizer.finish() if stream.detokenizer and reason != "abort" else ""
        stream.sink(_last(seq, tail, reason, error))

    def close_all(self, error: Unavailable) -> None:
        """Refuse new streams from now on and end every open one with `error`."""
        with self._lock:
            if self._closed_by is not None:
                return
            self._closed_by = error
            doomed, self._open = list(self._open.values()), {}
        for stream in doomed:
            stream.sink(_last(stream.seq, "", "error", error))

    def _finish_reason(self, stream: _Stream, token: int) -> str | None:
        params = stream.seq.params
        if stream.detokenizer is not None and stream.detokenizer.stopped:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self._eos_token_ids:
            return "stop"
        if len(stream.seq.output_token_ids) >= params.max_tokens:
            return "length"
        return None


def _last(seq: Sequence, text: str, reason: str, error: LoramuxError | None) -> Delta:
    """A stream's last delta: the text held back until now, the finish reason and the usage."""
    return Delta(
        seq.request_id,
        [],
        text,
        finish_reason=reason,
        prompt_tokens=len(seq.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        error=error,
        cached_tokens=seq.cached_tokens,
        preemptions=seq.preemptions,
    )
