"""SqliteCatalog: registered adapters in SQLite, one transaction per change."""

import threading

import pytest

from adapter_store.events import EventHub
from adapter_store.sqlite_catalog import SqliteCatalog
from shared.adapter_blob import digest
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from tests.adapter_store.conftest import record


@pytest.fixture
def catalog(tmp_path):
    catalog = SqliteCatalog(tmp_path / "catalog.sqlite", EventHub())
    yield catalog
    catalog.close()


def test_insert_get_and_list_pages_in_id_order(catalog):
    ids = ["delta", "alpha", "echo", "charlie", "bravo"]
    for adapter_id in ids:
        assert catalog.insert(record(adapter_id)) == (record(adapter_id), True)
    assert catalog.get("charlie") == record("charlie")
    assert catalog.get("zulu") is None
    pages, after = [], None
    while page := catalog.list(page_size=2, after=after):
        pages.append([r.adapter_id for r in page])
        after = page[-1].adapter_id
    assert pages == [["alpha", "bravo"], ["charlie", "delta"], ["echo"]]
    assert [r.adapter_id for r in catalog.list(10, "bravo")] == ["charlie", "delta", "echo"]
    assert [r.adapter_id for r in catalog.all()] == sorted(ids)
    with pytest.raises(InvalidArgument):
        catalog.list(0, None)


def test_same_digest_is_idempotent(catalog):
    first = record("a")
    catalog.insert(first)
    again = record("a", pinned=True)
    assert catalog.insert(again) == (first, False)
    assert catalog.get("a") == first


def test_different_digest_already_exists(catalog):
    catalog.insert(record("a", b"one"))
    with pytest.raises(AlreadyExists) as raised:
        catalog.insert(record("a", b"two"))
    message = str(raised.value)
    assert "'a'" in message and digest(b"one") in message and digest(b"two") in message
    assert catalog.get("a").digest == digest(b"one")


def test_delete_pinned_needs_force(catalog):
    catalog.insert(record("p", pinned=True))
    with pytest.raises(FailedPrecondition, match=r"pinned.*force"):
        catalog.delete("p", force=False)
    assert catalog.get("p") is not None
    assert catalog.delete("p", force=True) == record("p", pinned=True)
    assert catalog.get("p") is None
    with pytest.raises(NotFound, match="'p'"):
        catalog.delete("p", force=True)


def test_set_pinned(catalog):
    catalog.insert(record("a"))
    assert catalog.set_pinned("a", True).pinned
    assert catalog.get("a").pinned
    with pytest.raises(FailedPrecondition):
        catalog.delete("a", force=False)
    assert not catalog.set_pinned("a", False).pinned
    assert catalog.delete("a", force=False).adapter_id == "a"
    with pytest.raises(NotFound):
        catalog.set_pinned("missing", True)


def test_digest_in_use(catalog):
    catalog.insert(record("a", b"shared"))
    catalog.insert(record("b", b"shared"))
    catalog.delete("a", force=False)
    assert catalog.digest_in_use(digest(b"shared"))
    catalog.delete("b", force=False)
    assert not catalog.digest_in_use(digest(b"shared"))


def test_survives_close_and_reopen(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog = SqliteCatalog(path, EventHub())
    catalog.insert(record("a", pinned=True))
    catalog.insert(record("b", b"other"))
    catalog.close()
    reopened = SqliteCatalog(path, EventHub())
    assert reopened.all() == [record("a", pinned=True), record("b", b"other")]
    reopened.close()


@pytest.mark.parametrize("connections", ["shared", "one per thread"])
def test_concurrent_inserts_of_one_id_have_one_winner(catalog, tmp_path, connections):
    """One catalog shared by threads (the server), or one each (like separate processes)."""
    path = tmp_path / "catalog.sqlite"
    catalogs = [catalog if connections == "shared" else SqliteCatalog(path, EventHub()) for _ in range(8)]
    barrier = threading.Barrier(8)
    outcomes = []

    def insert(n: int) -> None:
        barrier.wait()
        try:
            outcomes.append(catalogs[n].insert(record("contested", f"blob {n}".encode()))[1])
        except AlreadyExists:
            outcomes.append("exists")

    threads = [threading.Thread(target=insert, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes, key=str) == [True] + ["exists"] * 7
    assert catalog.get("contested").digest in {digest(f"blob {n}".encode()) for n in range(8)}
    for other in set(catalogs) - {catalog}:
        other.close()
