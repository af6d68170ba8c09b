"""LocalAdapterLoader: adapters from PEFT folders on this machine."""

import os
import tempfile
from pathlib import Path

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.host_tier import ReadyAdapter
from inference_service.model.shard import Shard
from shared import adapter_blob
from shared.base_vocab import BaseVocab
from shared.errors import FailedPrecondition, NotFound
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter


class LocalAdapterLoader:
    """Each name maps to the folder and content it was last registered with. Every content ever
    registered stays loadable from its folder by digest (a path each), for the requests still
    bound to it after its name moved on; a folder whose files changed since is refused.

    Under tensor parallelism (`shard` of more than one rank) an adapter's image is rank 0's part
    of it, and its blob is written by digest to a folder of the loader's (it goes with the
    loader), for the other ranks to take theirs."""

    def __init__(
        self,
        model: ModelConfig,
        max_rank: int,
        dtype: torch.dtype,
        shard: Shard | None = None,
        base: BaseVocab | None = None,
    ):
        """base: the base model's embedding and head, which an adapter's saved copies must equal."""
        self._model, self._max_rank, self._dtype, self._shard = model, max_rank, dtype, shard
        self._base = base
        spooled = shard is not None and shard.size > 1
        self._spool = tempfile.TemporaryDirectory(prefix="loramux-adapter-blobs-") if spooled else None
        self._names: dict[str, str] = {}  # name -> digest new requests get
        self._folders: dict[str, Path] = {}  # digest -> folder it was registered from

    def register(self, name: str, folder: str | Path, digest: str) -> None:
        """New requests for `name` get the content `digest` read from `folder`."""
        self._names[name] = digest
        self._folders[digest] = Path(folder)

    def unregister(self, name: str) -> None:
        self._names.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def digest_of(self, name: str) -> str | None:
        return self._names.get(name)

    def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
        digest = digest or self._names.get(name)
        folder = self._folders.get(digest) if digest else None
        if folder is None:
            raise NotFound(f"adapter {name!r} is not registered")
        ready = self.read(name, folder)
        if ready.digest != digest:
            raise FailedPrecondition(
                f"adapter {name!r}: the files in {folder} changed after they were registered (content "
                f"{ready.digest}, registered as {digest}); register the adapter again"
            )
        return ready

    def read(self, name: str, folder: str | Path) -> ReadyAdapter:
        """Validate and optimize the PEFT checkpoint in `folder` as adapter `name`, without
        registering it."""
        weights = load_peft_adapter(name, folder, self._model, self._max_rank, self._dtype, self._base)
        if self._spool is None:
            return ReadyAdapter.of(name, weights, self._model, self._dtype, self._shard)
        blob = adapter_blob.encode(weights)
        digest = adapter_blob.digest(blob)
        path = Path(self._spool.name) / adapter_blob.file_name(digest)
        if not path.is_file():
            partial = path.with_name(path.name + ".partial")
            partial.write_bytes(blob)
            os.replace(partial, path)
        image = AdapterImage.of(weights, self._model, self._dtype, self._shard)
        return ReadyAdapter(name, digest, image, path)
