"""kill -9 during registrations: after a restart the catalog lists only complete adapters, every
blob verifies, and nothing half-written is left on disk."""

import hashlib
import threading
import time
from pathlib import Path

import grpc

from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import AUTH, StoreProcess, store_flags

SOURCES = ("qv4", "all8", "mlp16rs", "re2", "pattern")


def _register_until_killed(address: str, root: Path, worker: int, registered: list[str]) -> None:
    """Registers adapters one after another until the store dies; `registered` gets the
    acknowledged ones."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        for i in range(10_000):
            adapter_id = f"w{worker}-{i}"
            source = SOURCES[(worker + i) % len(SOURCES)]
            request = pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=f"file://{root / source}")
            try:
                stub.RegisterAdapter(request, metadata=AUTH, timeout=10)
            except grpc.RpcError:
                return  # the store is gone
            registered.append(adapter_id)


def _all_adapters(stub) -> list[pb.Adapter]:
    adapters, token = [], ""
    while True:
        page = stub.ListAdapters(pb.ListAdaptersRequest(page_size=50, page_token=token), metadata=AUTH)
        adapters += page.adapters
        if not (token := page.next_page_token):
            return adapters


def test_kill_during_registration_leaves_a_consistent_store(tmp_path, sources_root, s3_endpoint, tiny_models):
    data_dir = tmp_path / "data"
    flags = store_flags(sources_root, s3_endpoint, tiny_models)
    store = StoreProcess(data_dir, flags).start()
    registered: list[str] = []
    workers = [
        threading.Thread(target=_register_until_killed, args=(store.address, sources_root, w, registered))
        for w in range(4)
    ]
    for w in workers:
        w.start()
    while len(registered) < 20:
        time.sleep(0.01)
    store.kill()
    for w in workers:
        w.join(timeout=30)

    store = StoreProcess(data_dir, flags).start()
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        listed = _all_adapters(stub)
        assert set(registered) <= {a.adapter_id for a in listed}  # every acknowledged one survived
        for adapter in listed:
            fetch = stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter.adapter_id))
            blob = b"".join(r.chunk for r in fetch)
            assert len(blob) == adapter.size_bytes
            assert "sha256:" + hashlib.sha256(blob).hexdigest() == adapter.digest
    assert store.stop() == 0

    blob_files = list((data_dir / "blobs").rglob("*"))
    assert not [p for p in blob_files if p.name.startswith(".tmp")]
    on_disk = {"sha256:" + p.name for p in blob_files if p.is_file()}
    assert on_disk == {a.digest for a in listed}  # a blob whose row never landed was dropped
    assert list((data_dir / "incoming").iterdir()) == []
