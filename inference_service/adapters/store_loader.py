"""StoreAdapterLoader: adapters fetched from the adapter store, verified by digest and kept on
local disk by digest, so an adapter evicted from the host tier comes back without the store.

The store is untrusted input: a digest names a file only once it is "sha256:" + 64 hex, every
blob's hash is checked (as it is fetched, or on its first read from the cache in this process)
and every blob is validated against the model before the engine sees it."""

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.blob_fetch import BlobFetch, FetchLimits, ask_digest
from inference_service.adapters.host_tier import ReadyAdapter
from inference_service.model.shard import Shard
from shared import adapter_blob
from shared.errors import quoted
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StoreAdapterLoader:
    """Knows which adapter ids exist (and their digests) from the store's watch stream;
    `load` runs on a host-tier loader thread."""

    def __init__(
        self,
        channel: grpc.Channel,
        cache_dir: Path,
        model: ModelConfig,
        max_rank: int,
        dtype: torch.dtype,
        limits: FetchLimits | None = None,
        shard: Shard | None = None,
    ):
        """shard: under tensor parallelism, rank 0's: images hold its part of each adapter (the
        other ranks read the cached blob for theirs)."""
        self._stub = pb_grpc.AdapterStoreStub(channel)
        self._shard = shard
        self._cache = cache_dir
        self._cache.mkdir(parents=True, exist_ok=True)
        self._model, self._max_rank, self._dtype = model, max_rank, dtype
        self._limits = limits or FetchLimits()
        # digest -> (lock, users): one fetch per digest, so a partial file has one writer
        self._fetching: dict[str, tuple[threading.Lock, int]] = {}
        self._verified: set[str] = set()  # digests whose cached file was hashed in this process
        self._digests: dict[str, str] = {}  # adapter id -> digest, as the store last said
        self._synced = False  # whether _digests mirrors a live watch stream
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        """Unknown ids are refused only while the catalog view is live; otherwise a fetch decides."""
        with self._lock:
            return name in self._digests or not self._synced

    def learn(self, name: str, digest: str) -> None:
        _warn_if_invalid(name, digest)
        with self._lock:
            self._digests[name] = digest

    def unregister(self, name: str) -> None:
        with self._lock:
            self._digests.pop(name, None)

    def sync(self, digests: dict[str, str] | None) -> None:
        """The whole catalog from a fresh watch (None: the watch is down, the view is stale)."""
        with self._lock:
            self._synced = digests is not None
            if digests is not None:
                self._digests = dict(digests)
        for name, digest in (digests or {}).items():
            _warn_if_invalid(name, digest)

    def digest_of(self, name: str) -> str | None:
        with self._lock:
            return self._digests.get(name)

    def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
        """A given digest is fetched as it is, whatever the catalog says of the name now (a
        request bound to content re-registered since); the disk cache usually has it."""
        digest = self._digest_for(name, digest)
        with self._one_fetch(digest):
            path = self._cached(digest) or self._fetch(name, digest)
        where = f"adapter {name!r}"
        weights = adapter_blob.decode(path.read_bytes(), where, self._model, self._max_rank)
        # The store's digest names the registered content, whatever dtype this worker serves in.
        return ReadyAdapter(
            name, digest, AdapterImage.of(weights, self._model, self._dtype, self._shard), path
        )

    def _digest_for(self, name: str, digest: str | None) -> str:
        """The digest asked for (which the catalog gave once) or the catalog's, validated;
        without a catalog entry, the store's answer."""
        known = digest or self.digest_of(name)
        if known is None:
            digest = ask_digest(self._stub, name, self._limits)
            self.learn(name, digest)
            return digest
        return adapter_blob.check_digest(known, f"adapter {name!r}: the adapter store's catalog")

    @contextmanager
    def _one_fetch(self, digest: str) -> Iterator[None]:
        """Held while `digest` is looked up and fetched; fetches of other digests run meanwhile."""
        with self._lock:
            lock, users = self._fetching.get(digest, (threading.Lock(), 0))
            self._fetching[digest] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._fetching.pop(digest)
                if users > 1:
                    self._fetching[digest] = (lock, users - 1)

    def _cached(self, digest: str) -> Path | None:
        """The cached blob; hashed on its first use in this process, and deleted when corrupt."""
        path = self._cache / adapter_blob.file_name(digest)
        if not path.is_file():
            return None
        if digest not in self._verified:
            if path.stat().st_size > self._limits.max_bytes or _digest_of_file(path) != digest:
                log.warning("cached adapter blob %s is corrupt or too large; fetching it again", path.name)
                path.unlink(missing_ok=True)
                return None
            self._verified.add(digest)
        return path

    def _fetch(self, name: str, digest: str) -> Path:
        """Stream the blob into the cache, resuming a partial file, verify it, then rename."""
        path = self._cache / adapter_blob.file_name(digest)
        partial = path.with_name(path.name + ".partial")
        BlobFetch(self._stub, name, digest, partial, self._limits).run()
        os.replace(partial, path)
        self._verified.add(digest)
        return path


def _digest_of_file(path: Path) -> str:
    with open(path, "rb") as f:
        return adapter_blob.file_digest(f)


def _warn_if_invalid(name: str, digest: str) -> None:
    if not adapter_blob.is_digest(digest):
        log.warning(
            "the adapter store names adapter %r by an invalid digest %s; it cannot be served",
            name,
            quoted(digest),
        )
