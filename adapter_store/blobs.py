"""Blobs: the interface to optimized adapter blobs, and BlobStore, which keeps them on disk,
one file per digest at `root/sha256/<hex>`. BlobStore is the whole of it on a single node and
the local cache of S3Blobs (s3_blobs.py) when stores share a catalog.

A store process may be SIGKILLed at any moment, so a blob only ever appears under its final
name whole and fsynced (temp file, fsync, rename, fsync of the directory); temp files left by a
killed write are removed at start. Readers get an open file, so a delete never breaks a fetch
that is already streaming: on POSIX the descriptor keeps the unlinked file alive.
"""

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol

from shared.adapter_blob import digest as blob_digest
from shared.adapter_blob import file_digest, is_digest
from shared.errors import NotFound

_PREFIX = "sha256:"
# A leading dot and a non-hex word: a temp name can never be taken for a digest.
_TEMP_PREFIX = ".tmp-"


class Blobs(Protocol):
    def put(self, blob: bytes) -> str:
        """Keeps the blob under its digest, which it returns; a blob already there is left as is."""

    def open(self, digest: str) -> BinaryIO:
        """The blob as an open local file (a delete does not break it); NotFound when absent."""

    def delete(self, digest: str) -> None:
        """Drops this store's copy; gone already is fine."""

    def digests(self) -> set[str]:
        """The digests this store holds a copy of."""


def digest_hex(digest: str) -> str:
    """The 64 hex digits of a digest; NotFound for anything else. Strict, so a digest from a
    request can never name a path outside the blob directory or an S3 key outside the prefix."""
    if not is_digest(digest):
        raise NotFound(f"blob {digest!r} not found: not a sha256:<64 lowercase hex> digest")
    return digest.removeprefix(_PREFIX)


class BlobStore:
    def __init__(self, root: Path):
        self._dir = Path(root) / "sha256"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._remove_temp_files()

    def put(self, blob: bytes) -> str:
        digest = blob_digest(blob)
        path = self._path(digest)
        if not path.exists():
            self._write_atomically(path, blob)
        return digest

    def open(self, digest: str) -> BinaryIO:
        try:
            return self._path(digest).open("rb")
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found") from None

    def size(self, digest: str) -> int:
        try:
            return self._path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found") from None

    def exists(self, digest: str) -> bool:
        return is_digest(digest) and self._path(digest).is_file()

    def delete(self, digest: str) -> None:
        self._path(digest).unlink(missing_ok=True)

    def digests(self) -> set[str]:
        return {_PREFIX + name for name in os.listdir(self._dir) if is_digest(_PREFIX + name)}

    def verify(self, digest: str) -> bool:
        """Re-hashes the file: False when the bytes on disk no longer match their name."""
        with self.open(digest) as f:
            return file_digest(f) == digest

    def _path(self, digest: str) -> Path:
        return self._dir / digest_hex(digest)

    def _write_atomically(self, path: Path, blob: bytes) -> None:
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self._dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        """Makes the rename itself durable: without it a crash may lose the directory entry."""
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remove_temp_files(self) -> None:
        for path in self._dir.glob(f"{_TEMP_PREFIX}*"):
            path.unlink(missing_ok=True)
