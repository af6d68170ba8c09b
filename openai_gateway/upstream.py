"""Upstream: the gateway's SDK client and what it learns from the worker once (the base model)."""

from loramux import AsyncClient, ModelInfo
from shared.names import ADAPTER_ID

from .config import GatewayConfig
from .errors import ApiError, model_not_found


class Upstream:
    def __init__(self, config: GatewayConfig):
        tls = config.upstream_tls
        self.client = AsyncClient(
            config.worker,
            config.store,
            api_token=config.worker_token,
            admin_token=config.admin_token,
            timeout=config.timeout_s,
            tls_ca=None if tls.ca is None else str(tls.ca),
            tls_cert=None if tls.cert is None else str(tls.cert),
            tls_key=None if tls.key is None else str(tls.key),
        )
        self._served_name = config.served_model_name
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        """The worker's model, asked once: a gateway may start before its workers, so not at start."""
        if self._info is None:  # two first calls at once may both ask: the answers are the same
            self._info = await self.client.model_info()
        return self._info

    async def base_name(self) -> str:
        return self._served_name or (await self.model_info()).model_name

    async def adapter_for(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        if not isinstance(model, str) or not model:
            raise ApiError(400, "`model` must name the base model or an adapter", "model")
        if model == await self.base_name():
            return None
        if not ADAPTER_ID.fullmatch(model):
            raise model_not_found(model)
        return model

    async def close(self) -> None:
        await self.client.close()
