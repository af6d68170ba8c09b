"""Catalog: the registered adapters, as records, and the interface both backends implement.

SqliteCatalog (sqlite_catalog.py) is the embedded single-node default; S3Catalog (s3_catalog.py)
is shared by several stores. A catalog is the one source of its change events: it publishes what
its own writes change and, when others write it too, what it learns of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.errors import AlreadyExists


@dataclass(frozen=True)
class AdapterRecord:
    adapter_id: str
    digest: str  # "sha256:<hex>" of the optimized blob
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int  # of the optimized blob
    dtype: str  # serving dtype of the blob
    source_uri: str  # where the checkpoint was loaded from
    pinned: bool  # a pinned adapter is deleted only with force
    created_at: float  # unix seconds


class Catalog(Protocol):
    """Every method blocks; each write is atomic, also against other stores sharing the catalog."""

    def get(self, adapter_id: str) -> AdapterRecord | None:
        """The current record, None when the id is not registered."""

    def insert(self, record: AdapterRecord) -> tuple[AdapterRecord, bool]:
        """(record, True) when new; (existing, False) when the id already names the same blob;
        AlreadyExists when it names another."""

    def delete(self, adapter_id: str, force: bool) -> AdapterRecord:
        """The deleted record; NotFound, or FailedPrecondition for a pinned one without force."""

    def set_pinned(self, adapter_id: str, pinned: bool) -> AdapterRecord:
        """The record as it is now; NotFound when the id is not registered."""

    def list(self, page_size: int, after: str | None) -> list[AdapterRecord]:
        """One page in adapter_id order: ids strictly greater than `after` (None: from the start)."""

    def all(self) -> list[AdapterRecord]:
        """Every record, in adapter_id order."""

    def digest_in_use(self, digest: str) -> bool:
        """Whether a record names the blob, so the store knows when it may drop its copy."""

    def close(self) -> None:
        """Releases connections and stops background work."""


def existing_or_conflict(existing: AdapterRecord, record: AdapterRecord) -> tuple[AdapterRecord, bool]:
    """What inserting `record` under a taken id gives: the existing record when it names the same
    blob (registering is idempotent), ALREADY_EXISTS when it names other content."""
    if existing.digest != record.digest:
        raise AlreadyExists(
            f"adapter {record.adapter_id!r} already exists with digest {existing.digest}, not {record.digest}"
        )
    return existing, False
