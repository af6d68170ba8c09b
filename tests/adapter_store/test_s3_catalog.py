"""S3Catalog against moto's S3 server: several catalogs on one prefix stand for several stores.
Conditional writes decide every race (one registration of a name wins, a pin never brings a
deleted entry back), reads see other stores' writes at once, and a garbled entry is named."""

import json
import threading
import uuid

import boto3
import pytest
from botocore.config import Config

from adapter_store.events import EventHub
from adapter_store.s3_catalog import S3Catalog
from adapter_store.s3_prefix import S3Prefix
from shared.adapter_blob import digest
from shared.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from tests.adapter_store.conftest import BUCKET, record, s3

POLL_S = 60.0  # these tests read on demand; the poller must not be what makes them pass


@pytest.fixture
def uri() -> str:
    return f"s3://{BUCKET}/catalog-tests/{uuid.uuid4().hex}"


@pytest.fixture
def stores(s3_endpoint, uri):
    """Opens catalogs on one prefix, one per store (on a client of its own unless given one);
    closes them all at the end."""
    opened = []

    def open_catalog(client=None) -> S3Catalog:
        opened.append(S3Catalog(S3Prefix(uri, client or s3(s3_endpoint)), EventHub(), POLL_S))
        return opened[-1]

    yield open_catalog
    for catalog in opened:
        catalog.close()


def test_an_entry_written_by_one_store_is_read_by_another(stores, s3_endpoint, uri):
    a, b = stores(), stores()
    assert a.insert(record("alpha")) == (record("alpha"), True)
    assert b.get("alpha") == record("alpha")
    assert b.insert(record("alpha", pinned=True)) == (record("alpha"), False)  # same blob: no-op
    a.insert(record("bravo", b"other"))
    assert [r.adapter_id for r in b.list(page_size=1, after="alpha")] == ["bravo"]
    assert b.all() == [record("alpha"), record("bravo", b"other")]
    key = uri.removeprefix(f"s3://{BUCKET}/") + "/catalog/alpha.json"
    stored = json.loads(s3(s3_endpoint).get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert stored["digest"] == digest(b"blob") and stored["adapter_id"] == "alpha"


def test_concurrent_registrations_of_one_name_have_one_winner(stores):
    catalogs = [stores() for _ in range(6)]
    barrier = threading.Barrier(len(catalogs))
    outcomes: dict[int, object] = {}

    def insert(n: int) -> None:
        barrier.wait()
        try:
            outcomes[n] = catalogs[n].insert(record("contested", f"blob {n}".encode()))[1]
        except AlreadyExists as e:
            outcomes[n] = e

    threads = [threading.Thread(target=insert, args=(n,)) for n in range(len(catalogs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [n for n, outcome in outcomes.items() if outcome is True]
    assert len(winners) == 1 and len(outcomes) == len(catalogs)
    won = digest(f"blob {winners[0]}".encode())
    for outcome in outcomes.values():
        assert outcome is True or (isinstance(outcome, AlreadyExists) and won in str(outcome))
    assert {catalog.get("contested").digest for catalog in catalogs} == {won}


def test_new_content_under_a_taken_name_is_refused_by_every_store(stores):
    a, b = stores(), stores()
    a.insert(record("taken", b"one"))
    for catalog in (a, b):
        with pytest.raises(AlreadyExists, match=r"'taken'.*" + digest(b"one")):
            catalog.insert(record("taken", b"two"))
    assert b.get("taken").digest == digest(b"one")


def test_a_pin_through_one_store_holds_for_the_other(stores):
    a, b = stores(), stores()
    a.insert(record("held"))
    assert b.set_pinned("held", True).pinned
    with pytest.raises(FailedPrecondition, match=r"'held' is pinned.*force"):
        a.delete("held", force=False)  # a's own view still says unpinned; S3 decides
    assert a.get("held").pinned
    assert a.delete("held", force=True).pinned
    assert b.get("held") is None
    with pytest.raises(NotFound, match="'held'"):
        b.set_pinned("held", False)


def test_a_delete_racing_a_pin_from_another_store_is_refused(stores, s3_endpoint, uri):
    """Store A reads the unpinned entry, store B pins it, then A's delete reaches S3: it must act
    only on the version A read, so A reads again, finds the pin, and refuses without force."""
    client = s3(s3_endpoint)
    a, b = stores(client), stores()
    a.insert(record("raced"))
    pins: list[bool] = []

    def pin_first(**_) -> None:  # between A's read and A's DeleteObject, once
        if not pins:
            pins.append(b.set_pinned("raced", True).pinned)

    client.meta.events.register("before-call.s3.DeleteObject", pin_first)
    with pytest.raises(FailedPrecondition, match=r"'raced' is pinned.*force"):
        a.delete("raced", force=False)
    assert pins == [True]
    assert a.get("raced").pinned and b.get("raced").pinned
    key = uri.removeprefix(f"s3://{BUCKET}/") + "/catalog/raced.json"
    assert json.loads(s3(s3_endpoint).get_object(Bucket=BUCKET, Key=key)["Body"].read())["pinned"]


def test_pins_racing_a_delete_never_bring_the_entry_back(stores, s3_endpoint, uri):
    a, b = stores(), stores()
    for round_ in range(4):
        name = f"doomed-{round_}"
        a.insert(record(name))
        toggles: list[object] = []

        def toggle(name=name, toggles=toggles) -> None:
            while True:
                try:
                    b.set_pinned(name, len(toggles) % 2 == 0)
                except NotFound:
                    return
                toggles.append(True)

        toggler = threading.Thread(target=toggle)
        toggler.start()
        a.delete(name, force=True)
        toggler.join(timeout=30)
        assert not toggler.is_alive()
        assert a.get(name) is None and b.get(name) is None
    prefix = uri.removeprefix(f"s3://{BUCKET}/") + "/catalog/"
    assert s3(s3_endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix)["KeyCount"] == 0


def test_a_garbled_entry_is_named_and_the_rest_still_listed(stores, s3_endpoint, uri):
    a = stores()
    a.insert(record("fine"))
    key = uri.removeprefix(f"s3://{BUCKET}/") + "/catalog/garbled.json"
    s3(s3_endpoint).put_object(Bucket=BUCKET, Key=key, Body=b"{not json")
    b = stores()
    assert [r.adapter_id for r in b.all()] == ["fine"]
    with pytest.raises(Unavailable, match=r"catalog entry .*/catalog/garbled\.json is not a valid entry"):
        b.get("garbled")


def test_an_unreachable_bucket_is_unavailable_naming_it():
    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:1",
        config=Config(retries={"max_attempts": 1}),
        aws_access_key_id="x",
        aws_secret_access_key="x",
        region_name="us-east-1",
    )
    with pytest.raises(Unavailable, match=r"shared catalog s3://adapters/nowhere: .*http://127\.0\.0\.1:1"):
        S3Catalog(S3Prefix(f"s3://{BUCKET}/nowhere", client), EventHub(), POLL_S)
