"""`/v1/models`: the base model and every adapter in the store's catalog, as OpenAI model objects."""

from loramux import Adapter, NotFound
from shared.names import ADAPTER_ID

from .errors import model_not_found
from .upstream import Upstream

OWNER = "loramux"


class ModelCatalog:
    def __init__(self, upstream: Upstream, started: int):
        self._upstream = upstream
        self._started = started  # the base model's `created`: when this gateway started serving it

    async def all(self) -> list[dict]:
        """The base model first, then the adapters in id order, read from the store at each call
        (an adapter registered a moment ago through any gateway or the CLI is in it)."""
        base = await self._base()
        adapters = await self._upstream.client.list_adapters()
        return [base, *(self._adapter(a, base["id"]) for a in adapters)]

    async def one(self, model_id: str) -> dict:
        base = await self._base()
        if model_id == base["id"]:
            return base
        if not ADAPTER_ID.fullmatch(model_id):
            raise model_not_found(model_id)
        try:
            return self._adapter(await self._upstream.client.get_adapter(model_id), base["id"])
        except NotFound:
            raise model_not_found(model_id) from None

    async def _base(self) -> dict:
        name = await self._upstream.base_name()
        info = await self._upstream.model_info()
        return _model(name, self._started, root=info.model_name, parent=None) | {
            "max_model_len": info.max_model_len
        }

    def _adapter(self, adapter: Adapter, base: str) -> dict:
        created = int(adapter.created.timestamp()) if adapter.created else self._started
        return _model(adapter.adapter_id, created, root=adapter.source_uri, parent=base)


def _model(model_id: str, created: int, root: str, parent: str | None) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": OWNER,
        "root": root,
        "parent": parent,
    }
