"""BlobFetch: one adapter blob streamed from the adapter store into a partial file, bounded in
bytes (the header's size and --max-adapter-bytes) and in time (an idle and a total timeout), and
hashed as it is written. The store's bytes are untrusted until their sha256 is the digest asked
for; a store that stalls, lies about sizes or never stops only costs its own fetch."""

import hashlib
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from shared import adapter_blob
from shared.blob_limit import FLOOR_BYTES, default_max_adapter_bytes
from shared.errors import FailedPrecondition, InvalidArgument, LoramuxError, NotFound, Unavailable, quoted
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class FetchLimits:
    # Largest blob a worker takes; 0 (the flag's default): for_model sizes it for the base model.
    # Loaders built in process without a model at hand take 1 GiB.
    max_bytes: int = FLOOR_BYTES
    idle_timeout_s: float = 10.0  # longest wait for the next message of a fetch
    timeout_s: float = 120.0  # longest a whole fetch may take

    def __post_init__(self):
        if self.max_bytes < 0:
            raise InvalidArgument(f"max_adapter_bytes must not be negative, got {self.max_bytes}")
        for name, value in (("fetch_idle_timeout", self.idle_timeout_s), ("fetch_timeout", self.timeout_s)):
            if not value > 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {value}")

    def for_model(self, model: ModelConfig, max_rank: int) -> "FetchLimits":
        """These limits, a max_bytes of 0 made the largest blob an adapter of rank `max_rank` on
        `model` can be (at least 1 GiB): an MoE adapter is many times a dense one's size."""
        return replace(self, max_bytes=self.max_bytes or default_max_adapter_bytes(model, max_rank))


class IdleWatchdog:
    """Cancels `call` once `idle_s` pass without a `feed()`: a stalled fetch ends at the idle
    timeout, not the total one, and frees its loader thread."""

    def __init__(self, call: grpc.Future, idle_s: float):
        self._call, self._idle_s = call, idle_s
        self._deadline = time.monotonic() + idle_s
        self._stopped = threading.Event()
        self.fired = False
        threading.Thread(target=self._watch, name="fetch-watchdog", daemon=True).start()

    def feed(self) -> None:
        self._deadline = time.monotonic() + self._idle_s

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(max(0.0, self._deadline - time.monotonic())):
            if time.monotonic() >= self._deadline:
                self.fired = True
                self._call.cancel()
                return


class _StaleResume(Exception):
    """The store refused to resume where the partial file ends: start again from byte 0."""


class BlobFetch:
    """Blob `digest` of adapter `name` into `partial`, resuming from the end of what is there.
    After `run` the partial file holds exactly the blob, its hash checked."""

    def __init__(
        self, stub: pb_grpc.AdapterStoreStub, name: str, digest: str, partial: Path, limits: FetchLimits
    ):
        self._stub, self._digest, self._partial, self._limits = stub, digest, partial, limits
        self._where = f"adapter {name!r}"

    def run(self) -> None:
        if self._partial.exists():
            try:
                return self._attempt()
            except _StaleResume:
                self._partial.unlink(missing_ok=True)
        self._attempt()

    def _attempt(self) -> None:
        hasher, offset = self._resume()
        request = pb.FetchAdapterRequest(digest=self._digest, offset=offset)
        stream = self._stub.FetchAdapter(request, timeout=self._limits.timeout_s)
        watchdog = IdleWatchdog(stream, self._limits.idle_timeout_s)
        try:
            size = self._check_header(next(stream, None), offset)
            written = self._append(stream, watchdog, hasher, offset, size)
        except grpc.RpcError as e:
            raise self._rpc_error(e, offset, watchdog.fired) from None
        finally:
            watchdog.stop()
            stream.cancel()
        self._verify(hasher, written, size)

    def _resume(self) -> tuple["hashlib._Hash", int]:
        """The hash of the bytes already here (read once, in chunks) and their count."""
        if self._partial.exists() and self._partial.stat().st_size > self._limits.max_bytes:
            self._partial.unlink()
        if not self._partial.exists():
            return hashlib.sha256(), 0
        with open(self._partial, "rb") as f:
            return hashlib.file_digest(f, "sha256"), f.tell()

    def _check_header(self, response: pb.FetchAdapterResponse | None, offset: int) -> int:
        """The blob's size from the first message, refused before any byte is written."""
        if response is None or response.WhichOneof("part") != "header":
            raise Unavailable(f"{self._where}: the adapter store's fetch stream did not start with a header")
        header, limit = response.header, self._limits.max_bytes
        got = adapter_blob.check_digest(header.digest, f"{self._where}: the adapter store's fetch header")
        if got != self._digest:
            raise Unavailable(
                f"{self._where}: asked the adapter store for blob {self._digest}, it sent {got}"
            )
        if header.size_bytes > limit:
            self._partial.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"{self._where}: the adapter store says its blob is {header.size_bytes:,} bytes, above this "
                f"worker's limit of {limit:,} bytes (--max-adapter-bytes)"
            )
        if offset > 0 and header.size_bytes < offset:
            raise _StaleResume()
        if header.size_bytes < 0 or header.offset != offset:
            raise Unavailable(
                f"{self._where}: the adapter store's fetch header is inconsistent (size {header.size_bytes}, "
                f"offset {header.offset} for a request from byte {offset})"
            )
        return header.size_bytes

    def _append(self, stream, watchdog: IdleWatchdog, hasher, offset: int, size: int) -> int:
        """Chunks appended and hashed until the stream ends; cancelled past the header's size."""
        written = offset
        with open(self._partial, "ab") as out:
            for response in stream:
                watchdog.feed()
                chunk = response.chunk
                if written + len(chunk) > size:
                    self._partial.unlink()
                    raise Unavailable(
                        f"{self._where}: the adapter store sent more than the {size:,} bytes its fetch "
                        "header announced; the fetch was cancelled and its bytes discarded"
                    )
                out.write(chunk)
                hasher.update(chunk)
                written += len(chunk)
        return written

    def _verify(self, hasher, written: int, size: int) -> None:
        if written < size:
            raise Unavailable(
                f"{self._where}: the adapter store's fetch stream ended after {written:,} of {size:,} "
                "bytes; a retry resumes it"
            )
        got = "sha256:" + hasher.hexdigest()
        if got != self._digest:
            self._partial.unlink()
            raise Unavailable(
                f"{self._where}: the fetched bytes hash to {got}, not to the digest {self._digest} the "
                "adapter store gave; they were discarded"
            )

    def _rpc_error(self, e: grpc.RpcError, offset: int, idle: bool) -> LoramuxError | _StaleResume:
        code = e.code()
        if idle:
            return Unavailable(
                f"{self._where}: no data from the adapter store for {self._limits.idle_timeout_s:g} s "
                "(--fetch-idle-timeout); the fetch was cancelled"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Unavailable(
                f"{self._where}: the fetch took longer than {self._limits.timeout_s:g} s (--fetch-timeout); "
                "it was cancelled"
            )
        if offset > 0 and code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return _StaleResume()
        return rpc_error(e, self._where)


def ask_digest(stub: pb_grpc.AdapterStoreStub, name: str, limits: FetchLimits) -> str:
    """The digest the store serves for adapter `name` (when no catalog view says it): a fetch's
    header only, within the idle timeout."""
    where = f"adapter {name!r}"
    stream = stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=name), timeout=limits.idle_timeout_s)
    try:
        response = next(stream, None)
    except grpc.RpcError as e:
        raise rpc_error(e, where) from None
    finally:
        stream.cancel()
    if response is None or response.WhichOneof("part") != "header":
        raise Unavailable(f"{where}: the adapter store's fetch stream did not start with a header")
    return adapter_blob.check_digest(response.header.digest, f"{where}: the adapter store's fetch header")


def rpc_error(e: grpc.RpcError, where: str) -> LoramuxError:
    if e.code() == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"{where} is not registered in the adapter store")
    return Unavailable(
        f"{where} cannot be fetched from the adapter store: {e.code().name}: {quoted(e.details(), 200)}"
    )
