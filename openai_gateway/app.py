"""The gateway's ASGI app: routes that decode, call and encode, with auth, body limit and metrics."""

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loramux import LoramuxError

from . import adapters, completions
from .auth import require_bearer
from .config import GatewayConfig
from .errors import HANDLERS
from .metrics import GatewayMetrics, MetricsMiddleware
from .models import ModelCatalog
from .protocol import ChatCompletionRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest, parse_body
from .upstream import Upstream


def create_app(config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    # Opened in the app's event loop, where the SDK's gRPC channels must live.
    upstream: Upstream | None = None
    catalog: ModelCatalog | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        nonlocal upstream, catalog
        upstream = Upstream(config)
        catalog = ModelCatalog(upstream, started=int(time.time()))
        yield
        await upstream.close()

    app = FastAPI(
        title="loramux OpenAI-compatible gateway",
        lifespan=lifespan,
        exception_handlers=HANDLERS,
        openapi_url=None,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    limit = config.max_body_bytes
    max_generations = config.max_generations_per_request

    def api_key(request: Request) -> None:
        require_bearer(request, config.api_key, "API key")

    def admin(request: Request) -> None:
        """The admin token when there is one, else the API key (as the store guards its admin RPCs)."""
        require_bearer(
            request, config.admin_token or config.api_key, "admin token" if config.admin_token else "API key"
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        api_key(request)
        body = await parse_body(request, ChatCompletionRequest, limit)
        body.bound_generations(max_generations)
        return await completions.chat(request, body, upstream, metrics)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        api_key(request)
        body = await parse_body(request, CompletionRequest, limit)
        body.bound_generations(max_generations)
        return await completions.text(request, body, upstream, metrics)

    @app.get("/v1/models")
    async def list_models(request: Request):
        api_key(request)
        return JSONResponse({"object": "list", "data": await catalog.all()})

    @app.get("/v1/models/{model_id}")
    async def get_model(request: Request, model_id: str):
        api_key(request)
        return JSONResponse(await catalog.one(model_id))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        admin(request)
        return await adapters.load(await parse_body(request, LoadLoraRequest, limit), upstream)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        admin(request)
        return await adapters.unload(await parse_body(request, UnloadLoraRequest, limit), upstream)

    @app.get("/health")
    async def health():
        """200 once the worker answers (its model is known); 503 naming why not."""
        try:
            await upstream.model_info()
        except LoramuxError as e:
            return JSONResponse({"status": "unavailable", "reason": e.message}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
