"""The adapter store process through a real gRPC client: admin RPCs, fetch, watch, auth, health."""

import hashlib
import queue
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.random_adapter import write_random_adapter
from inference_service.adapters.host_tier import ReadyAdapter
from shared import adapter_blob
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from shared.peft_checkpoint import load_peft_adapter
from tests.adapter_store.conftest import AUTH, StoreProcess, upload_folder


def _register(stub, adapter_id: str, uri: str) -> pb.Adapter:
    request = pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=uri, request_id=f"req-{adapter_id}")
    return stub.RegisterAdapter(request, metadata=AUTH)


def _fetch(stub, offset: int = 0, **selector) -> tuple[pb.BlobHeader, list[bytes]]:
    responses = list(stub.FetchAdapter(pb.FetchAdapterRequest(offset=offset, **selector)))
    assert responses[0].WhichOneof("part") == "header"
    assert all(r.WhichOneof("part") == "chunk" for r in responses[1:])
    return responses[0].header, [r.chunk for r in responses[1:]]


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__"):
            list(result)
    return e.value.code(), e.value.details()


def test_register_from_disk_and_s3_gives_one_content_identity(stub, sources_root, s3_endpoint, tiny_models):
    local = _register(stub, "qv4-disk", f"file://{sources_root / 'qv4'}")
    remote = _register(stub, "qv4-s3", upload_folder(s3_endpoint, sources_root / "qv4", "team/qv4"))

    assert local.digest == remote.digest and local.digest.startswith("sha256:")
    assert (local.rank, local.alpha, list(local.target_modules)) == (4, 8.0, ["q_proj", "v_proj"])
    assert local.dtype == "float32" and local.state == pb.ADAPTER_STATE_READY and not local.pinned
    assert remote.source_uri == "s3://adapters/team/qv4"
    header, chunks = _fetch(stub, adapter_id="qv4-s3")
    blob = b"".join(chunks)
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == header.digest == local.digest
    assert header.size_bytes == len(blob) == local.size_bytes
    model = ModelConfig.from_dir(tiny_models["llama"])
    expected = load_peft_adapter("x", sources_root / "qv4", model, 16, torch.float32)
    got = adapter_blob.decode(blob)
    for key, module in expected.modules.items():
        assert torch.equal(got.modules[key].a, module.a) and torch.equal(got.modules[key].b_t, module.b_t)
    tensors = {t.name: tuple(t.shape) for t in header.tensors}
    assert tensors["layers.0.q_proj.lora_a"] == (4, 64)
    # the worker's own loader agrees
    assert ReadyAdapter.of("qv4", expected, model, torch.float32).digest == local.digest


def test_same_id_same_content_is_idempotent_and_new_content_already_exists(stub, sources_root):
    first = _register(stub, "idem", f"file://{sources_root / 'all8'}")
    again = _register(stub, "idem", f"file://{sources_root / 'all8'}")
    assert again.digest == first.digest and again.create_time == first.create_time

    code, details = _code(_register, stub, "idem", f"file://{sources_root / 're2'}")
    assert code == grpc.StatusCode.ALREADY_EXISTS and "idem" in details
    assert stub.GetAdapter(pb.GetAdapterRequest(adapter_id="idem"), metadata=AUTH).digest == first.digest


def test_list_paginates_in_id_order(stub, sources_root):
    for i in range(5):
        _register(stub, f"page-{i}", f"file://{sources_root / 'qv4'}")
    ids, token = [], ""
    for _ in range(10):
        page = stub.ListAdapters(pb.ListAdaptersRequest(page_size=2, page_token=token), metadata=AUTH)
        assert len(page.adapters) <= 2
        ids += [a.adapter_id for a in page.adapters]
        token = page.next_page_token
        if not token:
            break
    assert ids == sorted(ids)
    assert [i for i in ids if i.startswith("page-")] == [f"page-{i}" for i in range(5)]
    code, _ = _code(stub.ListAdapters, pb.ListAdaptersRequest(page_token="%%%"), metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_pin_then_delete_needs_force(stub, sources_root):
    _register(stub, "pinned", f"file://{sources_root / 'qv4'}")
    assert stub.PinAdapter(pb.PinAdapterRequest(adapter_id="pinned"), metadata=AUTH).pinned

    code, details = _code(stub.DeleteAdapter, pb.DeleteAdapterRequest(adapter_id="pinned"), metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "force" in details
    assert not stub.UnpinAdapter(pb.UnpinAdapterRequest(adapter_id="pinned"), metadata=AUTH).pinned
    stub.PinAdapter(pb.PinAdapterRequest(adapter_id="pinned"), metadata=AUTH)
    deleted = stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="pinned", force=True), metadata=AUTH)
    assert deleted.adapter.adapter_id == "pinned"
    code, _ = _code(stub.GetAdapter, pb.GetAdapterRequest(adapter_id="pinned"), metadata=AUTH)
    assert code == grpc.StatusCode.NOT_FOUND


def test_fetch_resumes_from_an_offset_and_by_digest(stub, sources_root):
    adapter = _register(stub, "resume", f"file://{sources_root / 'mlp16rs'}")
    _, chunks = _fetch(stub, adapter_id="resume")
    blob = b"".join(chunks)
    header, tail = _fetch(stub, offset=1000, digest=adapter.digest)
    assert header.offset == 1000 and header.digest == adapter.digest
    assert blob[:1000] + b"".join(tail) == blob
    _, nothing = _fetch(stub, offset=len(blob), adapter_id="resume")
    assert nothing == []

    past_end = pb.FetchAdapterRequest(adapter_id="resume", offset=len(blob) + 1)
    code, details = _code(stub.FetchAdapter, past_end)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "offset" in details
    unknown = ({"adapter_id": "nope"}, {"digest": "sha256:" + "0" * 64}, {"digest": "sha256:../../etc"})
    for selector in unknown:
        code, _ = _code(stub.FetchAdapter, pb.FetchAdapterRequest(**selector))
        assert code == grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def wide_stub(tmp_path_factory):
    """A second store, without a base model (self-consistency checks only) and with a higher
    rank limit, holding a ~9 MB adapter of a wider made-up model."""
    root = tmp_path_factory.mktemp("wide")
    model = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        }
    )
    write_random_adapter(model, root / "big", rank=64, seed=0)
    process = StoreProcess(root / "data", ["--allowed-root", str(root), "--max-lora-rank", "64"]).start()
    with grpc.insecure_channel(process.address) as channel:
        yield pb_grpc.AdapterStoreStub(channel), f"file://{root / 'big'}"
    assert process.stop() == 0


def test_fetch_streams_chunks_of_at_most_one_mib_and_survives_a_delete(wide_stub):
    stub, uri = wide_stub
    adapter = stub.RegisterAdapter(pb.RegisterAdapterRequest(adapter_id="big", source_uri=uri))
    assert adapter.size_bytes > 2 << 20 and adapter.rank == 64
    stream = stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id="big"))
    header = next(stream).header
    first = next(stream).chunk
    stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="big"))
    rest = [r.chunk for r in stream]
    blob = first + b"".join(rest)
    assert max(len(c) for c in [first, *rest]) <= 1 << 20 and len(rest) >= 2
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == header.digest == adapter.digest
    code, _ = _code(stub.FetchAdapter, pb.FetchAdapterRequest(adapter_id="big"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_watch_sends_the_catalog_then_every_change(stub, sources_root):
    _register(stub, "watch-old", f"file://{sources_root / 'qv4'}")
    events: queue.Queue = queue.Queue()
    stream = stub.WatchAdapters(pb.WatchAdaptersRequest())
    threading.Thread(target=lambda: [events.put(e) for e in _until_cancelled(stream)], daemon=True).start()

    def next_event():
        return events.get(timeout=10)

    snapshot = []
    while (event := next_event()).type != pb.AdapterEvent.TYPE_SYNCED:
        assert event.type == pb.AdapterEvent.TYPE_EXISTING
        snapshot.append(event.adapter.adapter_id)
    assert "watch-old" in snapshot

    _register(stub, "watch-new", f"file://{sources_root / 're2'}")
    stub.PinAdapter(pb.PinAdapterRequest(adapter_id="watch-new"), metadata=AUTH)
    stub.UnpinAdapter(pb.UnpinAdapterRequest(adapter_id="watch-new"), metadata=AUTH)
    stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="watch-new"), metadata=AUTH)
    seen = [next_event() for _ in range(4)]
    stream.cancel()
    T = pb.AdapterEvent
    assert [e.type for e in seen] == [T.TYPE_REGISTERED, T.TYPE_PINNED, T.TYPE_UNPINNED, T.TYPE_DELETED]
    assert {e.adapter.adapter_id for e in seen} == {"watch-new"}
    assert seen[1].adapter.pinned and not seen[2].adapter.pinned


def _until_cancelled(stream):
    try:
        yield from stream
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED


def test_admin_rpcs_need_the_token_and_data_rpcs_do_not(stub, sources_root):
    request = pb.GetAdapterRequest(adapter_id="anything")
    code, details = _code(stub.GetAdapter, request)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
    code, _ = _code(stub.GetAdapter, request, metadata=(("authorization", "Bearer wrong"),))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = _code(stub.GetAdapter, request, metadata=(("authorization", AUTH[0][1] + "x"),))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = _code(stub.RegisterAdapter, pb.RegisterAdapterRequest(adapter_id="x", source_uri="file:///"))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    _register(stub, "open-fetch", f"file://{sources_root / 'qv4'}")
    header, _ = _fetch(stub, adapter_id="open-fetch")
    assert header.digest


@pytest.mark.parametrize(
    ("uri", "code", "named"),
    [
        ("file:///etc", grpc.StatusCode.PERMISSION_DENIED, "/etc"),
        ("s3://other-bucket/x", grpc.StatusCode.PERMISSION_DENIED, "other-bucket"),
        ("http://example.com/a", grpc.StatusCode.INVALID_ARGUMENT, "http://example.com/a"),
        ("s3://adapters/missing", grpc.StatusCode.INVALID_ARGUMENT, "s3://adapters/missing has no"),
    ],
)
def test_sources_outside_what_is_allowed_are_refused(stub, uri, code, named):
    got, details = _code(_register, stub, "refused", uri)
    assert got == code and named in details


def test_bad_ids_and_unknown_adapters(stub, sources_root):
    code, details = _code(_register, stub, "../evil", f"file://{sources_root / 'qv4'}")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "../evil" in details
    code, details = _code(_register, stub, "name\n", f"file://{sources_root / 'qv4'}")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'name\\n'" in details
    code, _ = _code(stub.PinAdapter, pb.PinAdapterRequest(adapter_id="ghost"), metadata=AUTH)
    assert code == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection(store):
    with grpc.insecure_channel(store.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "loramux.store.v1.AdapterStore"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(reflection.ServerReflectionInfo(iter([request])))
        names = {s.name for s in response.list_services_response.service}
        assert "loramux.store.v1.AdapterStore" in names and "grpc.health.v1.Health" in names
