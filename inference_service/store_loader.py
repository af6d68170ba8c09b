"""StoreAdapterLoader: adapters fetched from the adapter store, verified by digest and kept on
local disk by digest, so an adapter evicted from the host tier comes back without the store."""

import hashlib
import os
import threading
from pathlib import Path

import grpc
import torch

from inference_service.host_tier import ReadyAdapter
from shared import adapter_blob
from shared.errors import InvalidArgument, LoramuxError, NotFound, Unavailable
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

FETCH_TIMEOUT_S = 120.0


class StoreAdapterLoader:
    """Knows which adapter ids exist (and their digests) from the store's watch stream;
    `load` runs on a host-tier loader thread."""

    def __init__(
        self, channel: grpc.Channel, cache_dir: Path, model: ModelConfig, max_rank: int, dtype: torch.dtype
    ):
        self._stub = pb_grpc.AdapterStoreStub(channel)
        self._cache = cache_dir
        self._cache.mkdir(parents=True, exist_ok=True)
        self._model, self._max_rank, self._dtype = model, max_rank, dtype
        self._fetching = threading.Lock()  # one fetch at a time: a resumed partial file has one writer
        self._digests: dict[str, str] = {}  # adapter id -> digest, as the store last said
        self._synced = False  # whether _digests mirrors a live watch stream
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        """Unknown ids are refused only while the catalog view is live; otherwise a fetch decides."""
        with self._lock:
            return name in self._digests or not self._synced

    def learn(self, name: str, digest: str) -> None:
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

    def digest_of(self, name: str) -> str | None:
        with self._lock:
            return self._digests.get(name)

    def load(self, name: str) -> ReadyAdapter:
        digest = self.digest_of(name)
        path = self._cache / digest.replace(":", "-") if digest else None
        if path is None or not path.is_file():
            with self._fetching:
                digest, path = self._fetch(name)
        weights = adapter_blob.decode(path.read_bytes())
        if weights.rank > self._max_rank:
            raise InvalidArgument(
                f"adapter {name!r} has rank {weights.rank}, above this worker's max_lora_rank "
                f"{self._max_rank}"
            )
        weights.check_fits(name, self._model)
        # The store's digest names the registered content, whatever dtype this worker serves in.
        return ReadyAdapter(name, digest, weights.to(self._dtype))

    def _fetch(self, name: str) -> tuple[str, Path]:
        """Stream the blob into the cache, resuming a partial file, verify it, then rename."""
        try:
            return self._fetch_once(name)
        except grpc.RpcError as e:
            raise _error(e, name) from None

    def _fetch_once(self, name: str) -> tuple[str, Path]:
        stream = self._stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=name), timeout=FETCH_TIMEOUT_S)
        header = next(stream).header
        partial = self._cache / (header.digest.replace(":", "-") + ".partial")
        if partial.exists() and partial.stat().st_size < header.size_bytes:
            stream.cancel()
            stream = self._stub.FetchAdapter(
                pb.FetchAdapterRequest(digest=header.digest, offset=partial.stat().st_size),
                timeout=FETCH_TIMEOUT_S,
            )
            next(stream)
        else:
            partial.unlink(missing_ok=True)
        with open(partial, "ab") as out:
            for response in stream:
                out.write(response.chunk)
        return header.digest, self._verified(name, header.digest, partial)

    def _verified(self, name: str, digest: str, partial: Path) -> Path:
        got = "sha256:" + hashlib.sha256(partial.read_bytes()).hexdigest()
        if got != digest:
            partial.unlink()
            raise Unavailable(f"adapter {name!r}: fetched bytes hash to {got}, the store said {digest}")
        path = partial.with_suffix("")
        os.replace(partial, path)
        self.learn(name, digest)
        return path


def _error(e: grpc.RpcError, name: str) -> LoramuxError:
    if e.code() == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"adapter {name!r} is not registered")
    return Unavailable(
        f"adapter {name!r} cannot be fetched from the adapter store: {e.code().name}: {e.details()}"
    )
