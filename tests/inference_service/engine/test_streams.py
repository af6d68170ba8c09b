"""Streams: the final delta of a request is its last, also when a dead engine's watchdog ends
every stream while an overrunning step is still emitting tokens."""

import threading

from inference_service.engine.detokenizer import IncrementalDetokenizer
from inference_service.engine.sequence import Sequence
from inference_service.engine.streams import Streams
from inference_service.sampling import SamplingParams
from shared.errors import Unavailable


def test_no_delta_follows_the_error_that_close_all_ends_a_stream_with(tokenizer, monkeypatch):
    """The step's thread is caught between finding the stream and sending its token (held in the
    detokenizer here) while the watchdog's close_all runs: the token goes out before the error or
    not at all. A consumer takes the last delta's finish reason as the end (Engine.stream), so a
    token after the error would leave it waiting for good."""
    streams = Streams(tokenizer, tokenizer.eos_token_ids)
    seq = Sequence("r", tokenizer.encode("Hello"), SamplingParams(max_tokens=8), None)
    deltas = []
    streams.open(seq, deltas.append)
    in_push, closed = threading.Event(), threading.Event()
    push = IncrementalDetokenizer.push

    def held_push(self, token_id: int) -> str:
        in_push.set()
        closed.wait(0.5)  # close_all gets this long to run in between; it cannot if emit keeps it out
        return push(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "push", held_push)
    step = threading.Thread(target=streams.emit, args=(seq, tokenizer.encode(" world")[0], None))
    step.start()
    assert in_push.wait(10)
    streams.close_all(Unavailable("the worker's engine failed (a step ran past 1 s); retry"))
    closed.set()
    step.join(10)

    assert deltas[-1].finish_reason == "error" and isinstance(deltas[-1].error, Unavailable)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
