"""S3Catalog: the catalog several stores share, one JSON object per adapter at
`<prefix>/catalog/<adapter_id>.json`.

Every write is one conditional request, so S3 itself decides races between stores: a
registration creates its entry with If-None-Match: * (of two stores registering one name, exactly
one creates it; the other reads the winner and gets ALREADY_EXISTS unless the content is the
same), and pin, unpin and delete act only on the version they read (If-Match: <etag>), re-reading
when another store got there first, so no write undoes one it never saw and no pin brings a
deleted entry back. Reads of one adapter go to S3 and see every store's writes at once.

Other stores' writes reach this store's watchers by polling: every `poll_s` one listing of the
catalog prefix (names and ETags) is compared with what this store knows, changed entries are
read, and the differences are published as the same events this store's own writes publish.
Listing pages and watch snapshots look first, so they are as fresh as a read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Iterator

from adapter_store.catalog import AdapterRecord, existing_or_conflict
from adapter_store.events import CatalogEvent, EventHub
from adapter_store.s3_prefix import S3Prefix
from shared.errors import FailedPrecondition, InvalidArgument, LoramuxError, NotFound, Unavailable, brief
from shared.names import ADAPTER_ID

log = logging.getLogger(__name__)
ENTRIES = "catalog"
SUFFIX = ".json"
ATTEMPTS = 8  # conditional writes lost to other stores before a write gives up
BACKOFF_S = 0.005  # after losing attempt i, wait a random time up to BACKOFF_S * 2**i
Entry = tuple[str, AdapterRecord]  # (ETag, record) of one version of an entry


class S3Catalog:
    def __init__(self, bucket: S3Prefix, events: EventHub, poll_s: float):
        """Reads the whole catalog once (UNAVAILABLE when S3 cannot be read), then polls."""
        self._bucket, self._events, self._poll_s = bucket, events, poll_s
        self._known: dict[str, Entry] = {}
        self._unreadable: dict[str, str] = {}  # name -> ETag of a version that is no valid entry
        self._lock = threading.Lock()  # this store's writes and refreshes, one at a time
        self._stop = threading.Event()
        self.refresh()
        self._poller = threading.Thread(target=self._poll, name="catalog-poll", daemon=True)
        self._poller.start()

    def get(self, adapter_id: str) -> AdapterRecord | None:
        entry = self._read(adapter_id)
        return None if entry is None else entry[1]

    def insert(self, record: AdapterRecord) -> tuple[AdapterRecord, bool]:
        body = _encode(record)
        for _ in _attempts():
            with self._lock:
                etag = self._bucket.put(_path(record.adapter_id), body, if_none_match=True)
                if etag is not None:
                    self._learn(record.adapter_id, (etag, record))
                    return record, True
            existing = self.get(record.adapter_id)  # None: deleted since; try again
            if existing is not None:
                return existing_or_conflict(existing, record)
        raise _contended(record.adapter_id)

    def delete(self, adapter_id: str, force: bool) -> AdapterRecord:
        for _ in _attempts():
            with self._lock:
                etag, record = self._require(adapter_id)
                if record.pinned and not force:
                    raise FailedPrecondition(f"adapter {adapter_id!r} is pinned; pass force to delete it")
                if self._bucket.delete(_path(adapter_id), if_match=etag):
                    self._learn(adapter_id, None)
                    return record
        raise _contended(adapter_id)

    def set_pinned(self, adapter_id: str, pinned: bool) -> AdapterRecord:
        for _ in _attempts():
            with self._lock:
                etag, before = self._require(adapter_id)
                record = dataclasses.replace(before, pinned=pinned)
                if record != before:
                    etag = self._bucket.put(_path(adapter_id), _encode(record), if_match=etag)
                if etag is not None:
                    self._learn(adapter_id, (etag, record))
                    return record
        raise _contended(adapter_id)

    def list(self, page_size: int, after: str | None) -> list[AdapterRecord]:
        if page_size < 1:
            raise InvalidArgument(f"page_size must be at least 1, got {page_size}")
        return [record for record in self.all() if after is None or record.adapter_id > after][:page_size]

    def all(self) -> list[AdapterRecord]:
        self.refresh()
        with self._lock:
            return [self._known[name][1] for name in sorted(self._known)]

    def digest_in_use(self, digest: str) -> bool:
        """As of this store's last look: it decides only whether to keep a local copy."""
        with self._lock:
            return any(record.digest == digest for _, record in self._known.values())

    def refresh(self) -> None:
        """Brings what this store knows up to S3, publishing each difference as an event."""
        with self._lock:
            listed = self._listing()
            for name in self._known.keys() - listed.keys():
                self._learn(name, None)
            for name, etag in listed.items():
                if etag != self._etag(name) and etag != self._unreadable.get(name):
                    self._learn(name, self._read_listed(name, etag))

    def close(self) -> None:
        self._stop.set()
        self._poller.join()

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.refresh()
            except LoramuxError as e:  # S3 unreachable: look again next time
                log.warning("%s", e)
            except Exception:  # a bug: the traceback, and still look again next time
                log.exception("polling the shared catalog %s failed", self._bucket.uri)

    def _listing(self) -> dict[str, str]:
        """Adapter id -> ETag of every entry; objects that are not named like one are ignored."""
        names = self._bucket.list(ENTRIES)
        ids = {name.removesuffix(SUFFIX): etag for name, etag in names.items() if name.endswith(SUFFIX)}
        return {adapter_id: etag for adapter_id, etag in ids.items() if ADAPTER_ID.fullmatch(adapter_id)}

    def _etag(self, adapter_id: str) -> str | None:
        entry = self._known.get(adapter_id)
        return None if entry is None else entry[0]

    def _read(self, adapter_id: str) -> Entry | None:
        found = self._bucket.get(_path(adapter_id))
        return None if found is None else (found[1], self._decode(found[0], adapter_id))

    def _read_listed(self, adapter_id: str, etag: str) -> Entry | None:
        """A listed entry's newest version. One that is not a valid entry counts as absent and
        is logged once, until it changes: the rest of the catalog is still followed."""
        found = self._bucket.get(_path(adapter_id))
        if found is None:
            return None
        try:
            return found[1], self._decode(found[0], adapter_id)
        except Unavailable as e:
            log.error("%s", e)
            self._unreadable[adapter_id] = etag
            return None

    def _decode(self, body: bytes, adapter_id: str) -> AdapterRecord:
        """A record from an entry's bytes; UNAVAILABLE naming the entry when they are not one
        (the store cannot serve an adapter its catalog garbles)."""
        where = f"catalog entry {self._bucket.uri}/{_path(adapter_id)}"
        try:
            fields = json.loads(body)
            fields["target_modules"] = tuple(fields["target_modules"])
            record = AdapterRecord(**fields)
        except (ValueError, TypeError, KeyError) as e:
            raise Unavailable(f"{where} is not a valid entry ({brief(e)})") from None
        if record.adapter_id != adapter_id:
            raise Unavailable(f"{where} names adapter {record.adapter_id!r}")
        return record

    def _require(self, adapter_id: str) -> Entry:
        entry = self._read(adapter_id)
        if entry is None:
            raise NotFound(f"adapter {adapter_id!r} not found")
        return entry

    def _learn(self, adapter_id: str, entry: Entry | None) -> None:
        """Records the entry's version now (None: gone) and publishes how it changed."""
        old = self._known.pop(adapter_id, None)
        if entry is not None:
            self._known[adapter_id] = entry
            self._unreadable.pop(adapter_id, None)
        for event in _changes(old and old[1], entry and entry[1]):
            self._events.publish(event)


def _changes(old: AdapterRecord | None, new: AdapterRecord | None) -> list[CatalogEvent]:
    """The events that turn `old` into `new` (None: absent), as a watcher of the store that made
    the change saw them."""
    if old is None:
        return [] if new is None else [CatalogEvent("registered", new)]
    if new is None:
        return [CatalogEvent("deleted", old)]
    if (old.digest, old.created_at) != (new.digest, new.created_at):  # deleted and registered again
        return [CatalogEvent("deleted", old), CatalogEvent("registered", new)]
    if old.pinned != new.pinned:
        return [CatalogEvent("pinned" if new.pinned else "unpinned", new)]
    return []


def _path(adapter_id: str) -> str:
    return f"{ENTRIES}/{adapter_id}{SUFFIX}"


def _encode(record: AdapterRecord) -> bytes:
    return json.dumps(dataclasses.asdict(record), sort_keys=True).encode()


def _attempts() -> Iterator[int]:
    """ATTEMPTS attempt numbers; before each retry a random wait that doubles each time, so two
    stores writing one entry in step fall out of step, and a writer busy on one entry (pins in a
    loop) cannot keep winning against a delete: without it the delete lost every try."""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, BACKOFF_S * 2**attempt))
        yield attempt


def _contended(adapter_id: str) -> Unavailable:
    return Unavailable(
        f"adapter {adapter_id!r}: its shared catalog entry changed under {ATTEMPTS} tries in a row; try again"
    )
