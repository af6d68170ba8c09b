"""Catalog: registered adapters in SQLite, one transaction per change."""

import threading

import pytest

from adapter_store.catalog import AdapterRecord, Catalog
from shared.adapter_blob import digest
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound


def _record(adapter_id: str, content: bytes = b"blob", pinned: bool = False) -> AdapterRecord:
    return AdapterRecord(
        adapter_id=adapter_id,
        digest=digest(content),
        rank=8,
        alpha=16.0,
        target_modules=("q_proj", "v_proj"),
        size_bytes=len(content),
        dtype="float32",
        source_uri=f"file:///adapters/{adapter_id}",
        pinned=pinned,
        created_at=1_700_000_000.5,
    )


@pytest.fixture
def catalog(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    yield catalog
    catalog.close()


def test_insert_get_and_list_pages_in_id_order(catalog):
    ids = ["delta", "alpha", "echo", "charlie", "bravo"]
    for adapter_id in ids:
        assert catalog.insert(_record(adapter_id)) == (_record(adapter_id), True)
    assert catalog.get("charlie") == _record("charlie")
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
    first = _record("a")
    catalog.insert(first)
    again = _record("a", pinned=True)
    assert catalog.insert(again) == (first, False)
    assert catalog.get("a") == first


def test_different_digest_already_exists(catalog):
    catalog.insert(_record("a", b"one"))
    with pytest.raises(AlreadyExists) as raised:
        catalog.insert(_record("a", b"two"))
    message = str(raised.value)
    assert "'a'" in message and digest(b"one") in message and digest(b"two") in message
    assert catalog.get("a").digest == digest(b"one")


def test_delete_pinned_needs_force(catalog):
    catalog.insert(_record("p", pinned=True))
    with pytest.raises(FailedPrecondition, match=r"pinned.*force"):
        catalog.delete("p", force=False)
    assert catalog.get("p") is not None
    assert catalog.delete("p", force=True) == _record("p", pinned=True)
    assert catalog.get("p") is None
    with pytest.raises(NotFound, match="'p'"):
        catalog.delete("p", force=True)


def test_set_pinned(catalog):
    catalog.insert(_record("a"))
    assert catalog.set_pinned("a", True).pinned
    assert catalog.get("a").pinned
    with pytest.raises(FailedPrecondition):
        catalog.delete("a", force=False)
    assert not catalog.set_pinned("a", False).pinned
    assert catalog.delete("a", force=False).adapter_id == "a"
    with pytest.raises(NotFound):
        catalog.set_pinned("missing", True)


def test_digest_in_use(catalog):
    catalog.insert(_record("a", b"shared"))
    catalog.insert(_record("b", b"shared"))
    catalog.delete("a", force=False)
    assert catalog.digest_in_use(digest(b"shared"))
    catalog.delete("b", force=False)
    assert not catalog.digest_in_use(digest(b"shared"))


def test_survives_close_and_reopen(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog = Catalog(path)
    catalog.insert(_record("a", pinned=True))
    catalog.insert(_record("b", b"other"))
    catalog.close()
    reopened = Catalog(path)
    assert reopened.all() == [_record("a", pinned=True), _record("b", b"other")]
    reopened.close()


@pytest.mark.parametrize("connections", ["shared", "one per thread"])
def test_concurrent_inserts_of_one_id_have_one_winner(catalog, tmp_path, connections):
    """One catalog shared by threads (the server), or one each (like separate processes)."""
    path = tmp_path / "catalog.sqlite"
    catalogs = [catalog if connections == "shared" else Catalog(path) for _ in range(8)]
    barrier = threading.Barrier(8)
    outcomes = []

    def insert(n: int) -> None:
        barrier.wait()
        try:
            outcomes.append(catalogs[n].insert(_record("contested", f"blob {n}".encode()))[1])
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
