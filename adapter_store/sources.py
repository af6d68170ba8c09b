"""Sources: copy a PEFT checkpoint from its source uri into a local folder.

Each kind of source (local_source, s3_source) only locates files and streams them; which files a
checkpoint must have, the pickle refusal and the size limit are decided here, once for all."""

import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, Protocol

from adapter_store.config import StoreConfig
from adapter_store.local_source import LocalSource
from adapter_store.s3_source import S3Source, s3_client
from shared import peft_vocab
from shared.errors import InvalidArgument
from shared.peft_checkpoint import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE, pickle_refusal

SCHEMES = ("file://", "s3://")
CHUNK_BYTES = 1 << 20
# The config is read whole into memory as JSON, and PEFT's largest is a few MB (trainable token
# indices for a whole 256k vocabulary take about 2 MB); the weights have the store's own limit.
CONFIG_BYTES = 4 << 20


class Source(Protocol):
    uri: str  # normalized, what the catalog records

    def size(self, name: str) -> int | None:
        """Bytes in file `name` of the checkpoint, None when absent; never reads the file."""

    def open(self, name: str) -> AbstractContextManager[BinaryIO]:
        """A stream of file `name`'s bytes."""


class Sources:
    """The sources of one store. Its S3 client is built once, on the first s3:// fetch: boto3
    clients are thread-safe, and building one costs more than fetching a small adapter."""

    def __init__(self, config: StoreConfig):
        self._config = config
        self._s3 = None
        self._lock = threading.Lock()

    def fetch(self, uri: str, dest: Path, where: str) -> str:
        """Copy the checkpoint at `uri` (adapter_config.json and adapter_model.safetensors) into
        the empty folder `dest`; returns the normalized source uri to record. `where` is e.g.
        "adapter 'x'" for messages. On error `dest` may hold a partial copy, for the caller to
        discard."""
        source = self._open(uri, where)
        for name in _checkpoint_files(source, where):
            _copy(source, name, self._limit(name), dest / name, where)
        return source.uri

    def _limit(self, name: str) -> int:
        limit = self._config.max_adapter_bytes
        return min(limit, CONFIG_BYTES) if name == CONFIG_FILE else limit

    def _open(self, uri: str, where: str) -> Source:
        if uri.startswith("file://"):
            return LocalSource(uri, self._config, where)
        if uri.startswith("s3://"):
            return S3Source(uri, self._config, where, self._s3_client)
        schemes = " or ".join(f"{scheme}..." for scheme in SCHEMES)
        raise InvalidArgument(f"{where}: source uri {uri!r} is not supported; use {schemes}")

    def _s3_client(self):
        with self._lock:
            if self._s3 is None:
                self._s3 = s3_client(self._config)
            return self._s3


def _checkpoint_files(source: Source, where: str) -> tuple[str, ...]:
    # Weights first: for a pickle-only checkpoint, the refusal is the message worth reading.
    if source.size(WEIGHTS_FILE) is None:
        pickles = [name for name in PICKLE_FILES if source.size(name) is not None]
        if pickles:
            raise pickle_refusal(where, pickles[0])
        raise InvalidArgument(f"{where}: {source.uri} has no {WEIGHTS_FILE}")
    if source.size(CONFIG_FILE) is None:
        raise InvalidArgument(f"{where}: {source.uri} has no {CONFIG_FILE}")
    if source.size(peft_vocab.NEW_EMBEDDINGS_FILE) is not None:
        raise peft_vocab.resized_layout_refusal(where)
    return CONFIG_FILE, WEIGHTS_FILE


def _copy(source: Source, name: str, limit: int, target: Path, where: str) -> None:
    size = source.size(name)
    if size is not None and size > limit:
        raise _too_large(where, name, f"{size} bytes", limit)
    copied = 0
    with source.open(name) as stream, target.open("xb") as out:
        # The file may have grown since it was measured, so the limit holds for what arrives.
        while chunk := stream.read(CHUNK_BYTES):
            copied += len(chunk)
            if copied > limit:
                raise _too_large(where, name, f"more than {limit} bytes", limit)
            out.write(chunk)


def _too_large(where: str, name: str, size: str, limit: int) -> InvalidArgument:
    return InvalidArgument(f"{where}: {name} is {size}, above this store's limit of {limit} bytes for it")
