"""S3Blobs: optimized blobs in the shared bucket at `<prefix>/blobs/sha256/<hex>`, served from a
local BlobStore that caches them.

A registration puts its blob here before the catalog entry that names it, so every entry a store
can read names a blob that is there; the key is the content's digest, so two stores writing the
same blob write the same bytes. Blobs are never deleted from S3: another store may be about to
name the very blob a delete leaves unreferenced, and S3 has no transaction over two objects.
Deleting drops only this store's cached copy. A blob read from S3 is hashed before it is cached,
so a damaged object never reaches a worker.
"""

from typing import BinaryIO

from adapter_store.blobs import BlobStore, digest_hex
from adapter_store.s3_prefix import S3Prefix
from shared.adapter_blob import digest as blob_digest
from shared.errors import NotFound, Unavailable


class S3Blobs:
    def __init__(self, bucket: S3Prefix, cache: BlobStore):
        self._bucket = bucket
        self._cache = cache

    def put(self, blob: bytes) -> str:
        digest = self._cache.put(blob)
        path = self._path(digest)
        if not self._bucket.exists(path):
            self._bucket.put(path, blob)
        return digest

    def open(self, digest: str) -> BinaryIO:
        path = self._path(digest)  # refuses a malformed digest before any call
        try:
            return self._cache.open(digest)
        except NotFound:
            self._download(digest, path)
        return self._cache.open(digest)

    def delete(self, digest: str) -> None:
        self._cache.delete(digest)

    def digests(self) -> set[str]:
        return self._cache.digests()

    def _download(self, digest: str, path: str) -> None:
        found = self._bucket.get(path)
        if found is None:
            raise NotFound(f"blob {digest} not found in {self._bucket.uri}")
        got = blob_digest(found[0])
        if got != digest:
            raise Unavailable(f"blob {digest} in {self._bucket.uri} is damaged: its bytes hash to {got}")
        self._cache.put(found[0])

    @staticmethod
    def _path(digest: str) -> str:
        return f"blobs/sha256/{digest_hex(digest)}"
