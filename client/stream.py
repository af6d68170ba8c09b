"""A Generate call as the caller sees it: deltas while it runs, the Completion once it ends.

Leaving the stream early (break, close, an exception in the loop body) cancels the call; the
worker then aborts the request and frees its slot and KV cache.
"""

from collections.abc import AsyncIterator, Iterator

import grpc

from shared.pb.loramux.inference.v1 import inference_pb2 as inference_pb

from . import convert
from .errors import LoramuxError, rpc_errors
from .types import Completion, Delta


class _Collector:
    """The deltas seen so far, and the Completion once the Final message has arrived."""

    def __init__(self):
        self.deltas: list[Delta] = []
        self.result: Completion | None = None

    def add(self, response: inference_pb.GenerateResponse) -> Delta | None:
        kind = response.WhichOneof("kind")
        if kind == "final":
            self.result = convert.completion(self.deltas, response.final)
        if kind != "delta":
            return None
        delta = convert.delta(response.delta)
        self.deltas.append(delta)
        return delta

    def check_ended(self) -> None:
        if self.result is None:
            raise LoramuxError("the worker ended the Generate stream without a final message")


class Stream:
    """Iterate for `Delta`s; afterwards `.result` is the `Completion` (None until the stream ends)."""

    def __init__(self, call: grpc.Call):
        self._call = call
        self._collector = _Collector()

    @property
    def result(self) -> Completion | None:
        return self._collector.result

    def __iter__(self) -> Iterator[Delta]:
        try:
            with rpc_errors():
                for response in self._call:
                    delta = self._collector.add(response)
                    if delta is not None:
                        yield delta
            self._collector.check_ended()
        finally:
            self.close()

    def close(self) -> None:
        """Cancels the call unless it has already ended."""
        self._call.cancel()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    """`async for` over `Delta`s; afterwards `.result` is the `Completion` (None until the end)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call
        self._collector = _Collector()

    @property
    def result(self) -> Completion | None:
        return self._collector.result

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        try:
            with rpc_errors():
                async for response in self._call:
                    delta = self._collector.add(response)
                    if delta is not None:
                        yield delta
            self._collector.check_ended()
        finally:
            self.close()

    def close(self) -> None:
        """Cancels the call unless it has already ended."""
        self._call.cancel()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
