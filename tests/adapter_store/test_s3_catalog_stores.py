"""Two adapter store processes on one shared catalog (`--catalog s3://...`, moto's S3 server):
what is registered through either is listed, got and fetched through both; a name is taken once
for all stores, also when two race for it; pins and deletes through one reach the other's
watchers within the poll lag; and every catalog entry in the bucket names a whole blob. (A store that
joins later reads the whole catalog: test_s3_catalog.py shows it for the catalog alone.)"""

import hashlib
import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import AUTH, BUCKET, StoreProcess, s3, store_flags

POLL_S = 0.2
T = pb.AdapterEvent


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"shared/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def shared_flags(sources_root, s3_endpoint, tiny_models, prefix) -> list[str]:
    catalog = ["--catalog", f"s3://{BUCKET}/{prefix}", "--catalog-poll-s", str(POLL_S)]
    return store_flags(sources_root, s3_endpoint, tiny_models, *catalog)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, shared_flags):
    """Stores A and B, each with its own data dir (its blob cache), as stubs; started side by
    side, as most of a start is importing torch."""
    processes = [StoreProcess(tmp_path_factory.mktemp(f"store-{n}"), shared_flags) for n in "ab"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(StoreProcess.start, processes))
    channels = [grpc.insecure_channel(p.address) for p in processes]
    yield [pb_grpc.AdapterStoreStub(channel) for channel in channels]
    for channel in channels:
        channel.close()
    assert [p.stop() for p in processes] == [0, 0]


def _register(stub, adapter_id: str, uri: str) -> pb.Adapter:
    return stub.RegisterAdapter(
        pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=uri), metadata=AUTH
    )


def _get(stub, adapter_id: str) -> pb.Adapter:
    return stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id), metadata=AUTH)


def _refusal(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value.code(), e.value.details()


def test_registered_through_one_store_is_listed_got_and_fetched_through_the_other(stores, sources_root):
    a, b = stores
    adapter = _register(a, "from-a", f"file://{sources_root / 'qv4'}")
    assert _get(b, "from-a") == adapter
    listed = b.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH).adapters
    assert adapter in listed
    fetch = list(b.FetchAdapter(pb.FetchAdapterRequest(adapter_id="from-a")))
    blob = b"".join(r.chunk for r in fetch[1:])
    assert fetch[0].header.digest == adapter.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert len(blob) == adapter.size_bytes


def test_new_content_under_a_taken_name_is_refused_by_both_stores(stores, sources_root):
    a, b = stores
    first = _register(a, "taken", f"file://{sources_root / 'all8'}")
    for stub in (a, b):
        code, details = _refusal(_register, stub, "taken", f"file://{sources_root / 're2'}")
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'taken'" in details and first.digest in details
    assert _register(b, "taken", f"file://{sources_root / 'all8'}") == first  # same content: idempotent
    assert _get(b, "taken").digest == first.digest


def test_two_stores_racing_for_one_name_one_wins(stores, sources_root, s3_endpoint, prefix):
    a, b = stores
    for round_ in range(3):
        name = f"race-{round_}"
        contenders = [(a, "qv4"), (b, "mlp16rs")] if round_ % 2 else [(a, "mlp16rs"), (b, "qv4")]
        barrier = threading.Barrier(2)
        outcomes: list = [None, None]

        def register(n: int, stub, source: str, name=name, barrier=barrier, outcomes=outcomes) -> None:
            barrier.wait()
            try:
                outcomes[n] = _register(stub, name, f"file://{sources_root / source}")
            except grpc.RpcError as e:
                outcomes[n] = e.code()

        threads = [threading.Thread(target=register, args=(n, *c)) for n, c in enumerate(contenders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [o for o in outcomes if isinstance(o, pb.Adapter)]
        assert len(winners) == 1 and grpc.StatusCode.ALREADY_EXISTS in outcomes, outcomes
        assert _get(a, name) == _get(b, name) == winners[0]
    _assert_every_entry_names_a_whole_blob(s3_endpoint, prefix)


def test_pins_and_deletes_through_one_store_reach_the_others_watchers(stores, sources_root):
    a, b = stores
    events = _watch(b)
    _register(a, "watched", f"file://{sources_root / 'pattern'}")
    started = time.monotonic()
    registered = events.next("watched")
    lag = time.monotonic() - started
    assert (registered.type, registered.adapter.adapter_id) == (T.TYPE_REGISTERED, "watched")
    assert lag < POLL_S + 2.0  # the poll interval, plus one listing and read on 2 busy cores

    a.PinAdapter(pb.PinAdapterRequest(adapter_id="watched"), metadata=AUTH)
    pinned = events.next("watched")
    assert pinned.type == T.TYPE_PINNED and pinned.adapter.pinned
    code, details = _refusal(b.DeleteAdapter, pb.DeleteAdapterRequest(adapter_id="watched"), metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "force" in details
    b.UnpinAdapter(pb.UnpinAdapterRequest(adapter_id="watched"), metadata=AUTH)  # b's own write
    assert events.next("watched").type == T.TYPE_UNPINNED
    a.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="watched"), metadata=AUTH)
    assert events.next("watched").type == T.TYPE_DELETED
    code, _ = _refusal(_get, b, "watched")
    assert code == grpc.StatusCode.NOT_FOUND
    events.close()


class _Events:
    """A WatchAdapters stream read on a thread of its own."""

    def __init__(self, stub):
        self._queue: queue.Queue = queue.Queue()
        self._stream = stub.WatchAdapters(pb.WatchAdaptersRequest())
        threading.Thread(target=self._read, daemon=True).start()

    def next(self, adapter_id: str | None = None, timeout_s: float = 15.0) -> pb.AdapterEvent:
        """The next event (about `adapter_id`, when given: other tests' adapters are skipped)."""
        while True:
            event = self._queue.get(timeout=timeout_s)
            if adapter_id in (None, event.adapter.adapter_id):
                return event

    def close(self) -> None:
        self._stream.cancel()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self._queue.put(event)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED


def _watch(stub) -> _Events:
    """A watch past its snapshot, so next() gives changes only."""
    events = _Events(stub)
    while events.next().type != T.TYPE_SYNCED:
        pass
    return events


def _assert_every_entry_names_a_whole_blob(endpoint: str, prefix: str) -> None:
    client = s3(endpoint)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/catalog/")
    entries = [
        json.loads(client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()) for o in listing["Contents"]
    ]
    assert entries
    for entry in entries:
        hex_digest = entry["digest"].removeprefix("sha256:")
        blob = client.get_object(Bucket=BUCKET, Key=f"{prefix}/blobs/sha256/{hex_digest}")["Body"].read()
        assert hashlib.sha256(blob).hexdigest() == hex_digest and len(blob) == entry["size_bytes"]
