"""A malicious adapter store: a real gRPC server on loopback speaking the real AdapterStore proto,
whose catalog and fetch streams lie in whatever way each adapter is set up to."""

import threading
import time
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass

import grpc

from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

CHUNK = 1 << 20
Event = pb.AdapterEvent


@dataclass(frozen=True)
class Served:
    """One adapter as the fake store presents it."""

    blob: bytes  # the bytes its fetch streams
    digest: str  # what WatchAdapters says (and the fetch header, unless header_digest is set)
    behaviour: str = "serve"  # serve | truncate | endless | stall | drip | pause
    claimed_size: int | None = None  # the header's size_bytes (default: the blob's size)
    header_digest: str | None = None


class HostileStore(pb_grpc.AdapterStoreServicer):
    def __init__(self, served: dict[str, Served]):
        self.served = served
        self.fetches: dict[str, list[int]] = defaultdict(list)  # adapter id -> offsets asked for
        self.fetch_started: dict[str, threading.Event] = defaultdict(threading.Event)
        self.released = threading.Event()  # ends every stalled fetch with UNAVAILABLE
        self.resumed = threading.Event()  # lets every paused fetch send the rest of its blob
        self.address = ""  # HOST:PORT once started

    def WatchAdapters(self, request, context):
        for name, served in self.served.items():
            adapter = pb.Adapter(adapter_id=name, digest=served.digest, state=pb.ADAPTER_STATE_READY)
            yield pb.AdapterEvent(type=Event.TYPE_EXISTING, adapter=adapter)
        yield pb.AdapterEvent(type=Event.TYPE_SYNCED)
        while context.is_active():
            time.sleep(0.1)

    def FetchAdapter(self, request, context):
        name = self._find(request)
        if name is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such adapter")
        served = self.served[name]
        self.fetches[name].append(request.offset)
        self.fetch_started[name].set()
        size = len(served.blob) if served.claimed_size is None else served.claimed_size
        digest = served.header_digest or served.digest
        yield pb.FetchAdapterResponse(
            header=pb.BlobHeader(digest=digest, size_bytes=size, offset=request.offset)
        )
        yield from getattr(self, "_" + served.behaviour)(served.blob[request.offset :], context)

    def _find(self, request) -> str | None:
        if request.adapter_id:
            return request.adapter_id if request.adapter_id in self.served else None
        return next((n for n, s in self.served.items() if s.digest == request.digest), None)

    def _serve(self, blob: bytes, context):
        for start in range(0, len(blob), CHUNK):
            yield pb.FetchAdapterResponse(chunk=blob[start : start + CHUNK])

    def _truncate(self, blob: bytes, context):
        yield pb.FetchAdapterResponse(chunk=blob[: len(blob) // 2])

    def _endless(self, blob: bytes, context):
        chunk = b"\0" * CHUNK
        while context.is_active():
            yield pb.FetchAdapterResponse(chunk=chunk)

    def _stall(self, blob: bytes, context):
        while context.is_active():
            if self.released.wait(0.1):
                context.abort(grpc.StatusCode.UNAVAILABLE, "the stall was released")
        yield from ()

    def _pause(self, blob: bytes, context):
        """Half the blob, then the rest once `resumed` is set: a fetch caught in flight."""
        yield pb.FetchAdapterResponse(chunk=blob[: len(blob) // 2])
        while not self.resumed.wait(0.1):
            if not context.is_active():
                return
        yield pb.FetchAdapterResponse(chunk=blob[len(blob) // 2 :])

    def _drip(self, blob: bytes, context):
        """One byte every 0.2 s: never idle, never done."""
        while context.is_active():
            time.sleep(0.2)
            yield pb.FetchAdapterResponse(chunk=b"\0")


def start(servicer: HostileStore) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    pb_grpc.add_AdapterStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    return server
