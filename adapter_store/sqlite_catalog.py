"""SqliteCatalog: the registered adapters in SQLite, the embedded single-node catalog.

WAL with synchronous=FULL: a committed registration survives a SIGKILL or power loss, and a
killed transaction leaves nothing behind. One connection, shared by the event loop thread and
worker threads, is serialized by a lock; writes take `BEGIN IMMEDIATE`, so a check-then-insert
is one transaction even against another process on the same file.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from adapter_store.catalog import AdapterRecord, existing_or_conflict
from adapter_store.events import CatalogEvent, EventHub
from shared.errors import FailedPrecondition, InvalidArgument, NotFound

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS adapters (
    adapter_id TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    rank INTEGER NOT NULL,
    alpha REAL NOT NULL,
    target_modules TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    source_uri TEXT NOT NULL,
    pinned INTEGER NOT NULL,
    created_at REAL NOT NULL
    )""",
    # digest_in_use runs on every delete, to decide whether the blob can go too.
    "CREATE INDEX IF NOT EXISTS adapters_digest ON adapters (digest)",
)

_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(AdapterRecord))
_COLUMNS = ", ".join(_FIELD_NAMES)
_SELECT = f"SELECT {_COLUMNS} FROM adapters"
_INSERT = f"INSERT INTO adapters ({_COLUMNS}) VALUES ({', '.join('?' * len(_FIELD_NAMES))})"


def _to_row(record: AdapterRecord) -> tuple:
    """The columns in field order; SQLite has no tuple type, so the modules go as JSON text."""
    row = {name: getattr(record, name) for name in _FIELD_NAMES}
    row["target_modules"] = json.dumps(list(record.target_modules))
    return tuple(row.values())


def _from_row(row: tuple) -> AdapterRecord:
    fields = dict(zip(_FIELD_NAMES, row, strict=True))
    fields["target_modules"] = tuple(json.loads(fields["target_modules"]))
    fields["pinned"] = bool(fields["pinned"])
    return AdapterRecord(**fields)


class SqliteCatalog:
    def __init__(self, path: Path, events: EventHub):
        # Autocommit mode: transactions are begun explicitly, and only around writes.
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._events = events
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        with self._transaction():
            for statement in _SCHEMA:
                self._conn.execute(statement)

    def get(self, adapter_id: str) -> AdapterRecord | None:
        with self._lock:
            return self._get(adapter_id)

    def insert(self, record: AdapterRecord) -> tuple[AdapterRecord, bool]:
        with self._transaction():
            existing = self._get(record.adapter_id)
            if existing is None:
                self._conn.execute(_INSERT, _to_row(record))
        if existing is not None:
            return existing_or_conflict(existing, record)
        self._events.publish(CatalogEvent("registered", record))
        return record, True

    def delete(self, adapter_id: str, force: bool) -> AdapterRecord:
        with self._transaction():
            record = self._require(adapter_id)
            if record.pinned and not force:
                raise FailedPrecondition(f"adapter {adapter_id!r} is pinned; pass force to delete it")
            self._conn.execute("DELETE FROM adapters WHERE adapter_id = ?", (adapter_id,))
        self._events.publish(CatalogEvent("deleted", record))
        return record

    def set_pinned(self, adapter_id: str, pinned: bool) -> AdapterRecord:
        with self._transaction():
            before = self._require(adapter_id)
            self._conn.execute(
                "UPDATE adapters SET pinned = ? WHERE adapter_id = ?", (int(pinned), adapter_id)
            )
        record = dataclasses.replace(before, pinned=pinned)
        if before.pinned != pinned:
            self._events.publish(CatalogEvent("pinned" if pinned else "unpinned", record))
        return record

    def list(self, page_size: int, after: str | None) -> list[AdapterRecord]:
        if page_size < 1:
            raise InvalidArgument(f"page_size must be at least 1, got {page_size}")
        with self._lock:
            rows = self._conn.execute(
                f"{_SELECT} WHERE ? IS NULL OR adapter_id > ? ORDER BY adapter_id LIMIT ?",
                (after, after, page_size),
            ).fetchall()
        return [_from_row(row) for row in rows]

    def all(self) -> list[AdapterRecord]:
        with self._lock:
            rows = self._conn.execute(f"{_SELECT} ORDER BY adapter_id").fetchall()
        return [_from_row(row) for row in rows]

    def digest_in_use(self, digest: str) -> bool:
        with self._lock:
            row = self._conn.execute("SELECT 1 FROM adapters WHERE digest = ? LIMIT 1", (digest,)).fetchone()
        return row is not None

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _get(self, adapter_id: str) -> AdapterRecord | None:
        row = self._conn.execute(f"{_SELECT} WHERE adapter_id = ?", (adapter_id,)).fetchone()
        return None if row is None else _from_row(row)

    def _require(self, adapter_id: str) -> AdapterRecord:
        record = self._get(adapter_id)
        if record is None:
            raise NotFound(f"adapter {adapter_id!r} not found")
        return record

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Holds the lock for one write transaction; any exception rolls it back."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
