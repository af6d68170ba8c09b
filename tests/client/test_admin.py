"""Store admin calls through loramux.Client and loramux.AsyncClient against a real store process."""

import asyncio
from datetime import UTC

import grpc
import pytest

import loramux
from tests.adapter_store.conftest import ADMIN_TOKEN


@pytest.fixture
def client(store):
    with loramux.Client(store=store.address, admin_token=ADMIN_TOKEN, timeout=30) as client:
        yield client


def test_register_get_and_list_every_page(client, sources_root):
    registered = [
        client.register_adapter(name, f"file://{sources_root / source}", request_id=f"req-{name}")
        for name, source in [("list-b", "all8"), ("list-a", "qv4"), ("list-c", "qv4")]
    ]

    qv4 = client.get_adapter("list-a")
    assert qv4 == registered[1]
    assert (qv4.rank, qv4.alpha, qv4.target_modules, qv4.dtype) == (4, 8.0, ["q_proj", "v_proj"], "float32")
    assert qv4.digest.startswith("sha256:") and qv4.digest == registered[2].digest != registered[0].digest
    assert qv4.size_bytes > 0 and qv4.source_uri == f"file://{sources_root / 'qv4'}" and not qv4.pinned
    assert qv4.created.tzinfo == UTC
    for page_size in (0, 1, 2):  # 1 and 2 need the next_page_token to be followed
        ids = [a.adapter_id for a in client.list_adapters(page_size=page_size)]
        assert ids == sorted(ids)
        assert [i for i in ids if i.startswith("list-")] == ["list-a", "list-b", "list-c"]


def test_pin_unpin_and_a_pinned_adapter_needs_force_to_delete(client, sources_root):
    client.register_adapter("pinme", f"file://{sources_root / 'qv4'}")
    assert client.pin_adapter("pinme").pinned and client.get_adapter("pinme").pinned

    with pytest.raises(loramux.FailedPrecondition) as e:
        client.delete_adapter("pinme")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "pinme" in e.value.message
    assert not client.unpin_adapter("pinme").pinned
    client.pin_adapter("pinme")
    assert client.delete_adapter("pinme", force=True).adapter_id == "pinme"
    with pytest.raises(loramux.NotFound):
        client.get_adapter("pinme")


def test_unknown_adapter_is_not_found(client):
    with pytest.raises(loramux.NotFound) as e:
        client.get_adapter("no-such-adapter")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in e.value.message
    assert isinstance(e.value, loramux.LoramuxError)


def test_new_content_under_a_taken_id_already_exists(client, sources_root):
    client.register_adapter("taken", f"file://{sources_root / 'qv4'}")
    with pytest.raises(loramux.AlreadyExists):
        client.register_adapter("taken", f"file://{sources_root / 'all8'}")


def test_missing_token_is_unauthenticated_and_a_wrong_one_permission_denied(store):
    with loramux.Client(store=store.address) as anonymous, pytest.raises(loramux.Unauthenticated) as e:
        anonymous.list_adapters()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with (
        loramux.Client(store=store.address, admin_token="wrong") as wrong,
        pytest.raises(loramux.PermissionDenied),
    ):
        wrong.list_adapters()


def test_unreachable_store_is_unavailable():
    with loramux.Client(store="127.0.0.1:1", timeout=10) as client, pytest.raises(loramux.Unavailable):
        client.get_adapter("x")


def test_async_client_gives_the_same_answers_and_errors(store, sources_root):
    async def scenario():
        async with loramux.AsyncClient(store=store.address, admin_token=ADMIN_TOKEN, timeout=30) as client:
            registered = await client.register_adapter("async-a", f"file://{sources_root / 'all8'}")
            assert (registered.rank, registered.alpha) == (8, 16.0)
            assert await client.get_adapter("async-a") == registered
            ids = [a.adapter_id for a in await client.list_adapters(page_size=1)]
            assert "async-a" in ids and ids == sorted(ids)
            assert (await client.pin_adapter("async-a")).pinned
            with pytest.raises(loramux.FailedPrecondition) as e:
                await client.delete_adapter("async-a")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert not (await client.unpin_adapter("async-a")).pinned
            assert (await client.delete_adapter("async-a")).digest == registered.digest
            with pytest.raises(loramux.NotFound):
                await client.get_adapter("async-a")
        async with loramux.AsyncClient(store=store.address) as anonymous:
            with pytest.raises(loramux.Unauthenticated):
                await anonymous.list_adapters()

    asyncio.run(scenario())
