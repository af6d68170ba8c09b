"""Store: registration (fetch, validate, optimize, keep), the catalog operations, and blob reads.
Every method but subscribe() blocks; the servicer runs them on worker threads."""

import io
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

from adapter_store.blobs import Blobs, BlobStore
from adapter_store.catalog import AdapterRecord, Catalog
from adapter_store.config import StoreConfig
from adapter_store.events import EventHub, Subscription
from adapter_store.s3_blobs import S3Blobs
from adapter_store.s3_catalog import S3Catalog
from adapter_store.s3_prefix import S3Prefix
from adapter_store.s3_source import s3_client
from adapter_store.sources import Sources
from adapter_store.sqlite_catalog import SqliteCatalog
from shared import adapter_blob
from shared.base_vocab import BaseVocab
from shared.errors import InvalidArgument, NotFound
from shared.model_config import ModelConfig
from shared.names import check_adapter_id
from shared.peft_checkpoint import load_peft_adapter


class Store:
    def __init__(self, config: StoreConfig):
        self.config = config
        self._incoming = config.data_dir / "incoming"
        shutil.rmtree(self._incoming, ignore_errors=True)  # left by a registration that was killed
        self._incoming.mkdir(parents=True)
        self.events = EventHub()
        self.catalog, self.blobs = _backends(config, self.events)
        self._sources = Sources(config)
        self._model = ModelConfig.from_dir(config.base_model) if config.base_model else None
        self._base = BaseVocab(config.base_model, self._model) if config.base_model else None
        # Blob writes and catalog rows change together under this lock, so a delete never
        # removes a blob that a registration is about to reference.
        self._lock = threading.Lock()
        self._drop_unreferenced_blobs()

    def register(self, adapter_id: str, source_uri: str) -> tuple[AdapterRecord, bool]:
        """The adapter and whether this call created it (False: same content already there)."""
        check_adapter_id(adapter_id)
        where = f"adapter {adapter_id!r}"
        with tempfile.TemporaryDirectory(dir=self._incoming) as folder:
            source = self._sources.fetch(source_uri, Path(folder), where)
            weights = load_peft_adapter(
                adapter_id,
                folder,
                self._model,
                self.config.max_lora_rank,
                self.config.torch_dtype,
                self._base,
            )
        blob = adapter_blob.encode(weights)
        with self._lock:
            digest = self.blobs.put(blob)  # before the record that names it
            return self.catalog.insert(
                AdapterRecord(
                    adapter_id=adapter_id,
                    digest=digest,
                    rank=weights.rank,
                    alpha=weights.alpha,
                    target_modules=weights.target_modules,
                    size_bytes=len(blob),
                    dtype=self.config.dtype,
                    source_uri=source,
                    pinned=False,
                    created_at=time.time(),
                )
            )

    def get(self, adapter_id: str) -> AdapterRecord:
        record = self.catalog.get(adapter_id)
        if record is None:
            raise NotFound(f"adapter {adapter_id!r} is not registered")
        return record

    def page(self, page_size: int, after: str | None) -> list[AdapterRecord]:
        return self.catalog.list(page_size, after)

    def delete(self, adapter_id: str, force: bool) -> AdapterRecord:
        with self._lock:
            record = self.catalog.delete(adapter_id, force)
            if not self.catalog.digest_in_use(record.digest):
                self.blobs.delete(record.digest)  # streams already open keep their file
        return record

    def set_pinned(self, adapter_id: str, pinned: bool) -> AdapterRecord:
        return self.catalog.set_pinned(adapter_id, pinned)

    def open_blob(self, adapter_id: str, digest: str) -> tuple[BinaryIO, str]:
        """An open blob file and its digest, by adapter id or else by digest. Not under the lock:
        an open file outlives a delete, and a blob fetched from a shared catalog's bucket must
        not hold up registrations meanwhile."""
        if adapter_id:
            digest = self.get(adapter_id).digest
        elif not digest:
            raise InvalidArgument("FetchAdapter needs an adapter_id or a digest")
        return self.blobs.open(digest), digest

    def blob_info(self, f: BinaryIO) -> adapter_blob.BlobInfo:
        info = adapter_blob.read_info(f)
        f.seek(0, io.SEEK_SET)
        return info

    def subscribe(self) -> Subscription:
        """Live catalog changes; on the event loop. Subscribe before taking the snapshot: an
        adapter registered in between then shows up twice (existing, registered), never zero."""
        return self.events.subscribe()

    def snapshot(self) -> list[AdapterRecord]:
        return self.catalog.all()

    def close(self) -> None:
        self.catalog.close()

    def _drop_unreferenced_blobs(self) -> None:
        # A kill between writing a blob and inserting its row leaves a complete blob nobody names.
        referenced = {record.digest for record in self.catalog.all()}
        for digest in self.blobs.digests() - referenced:
            self.blobs.delete(digest)


def _backends(config: StoreConfig, events: EventHub) -> tuple[Catalog, Blobs]:
    """SQLite and blobs in the data dir by default; with `config.catalog`, the catalog and blobs
    other stores share in S3, blobs cached in the data dir."""
    local = BlobStore(config.data_dir / "blobs")
    if config.catalog is None:
        return SqliteCatalog(config.data_dir / "catalog.sqlite", events), local
    bucket = S3Prefix(config.catalog, s3_client(config))
    return S3Catalog(bucket, events, config.catalog_poll_s), S3Blobs(bucket, local)
