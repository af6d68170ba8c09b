"""The engine: continuous batching of requests over the model, with a scheduler, a block allocator,
paged adapter memory, a model runner, a sampler and incremental detokenizing. What it exports here is
the in-process API of DESIGN.md."""

from inference_service.engine.config import EngineConfig
from inference_service.engine.engine import Engine
from inference_service.engine.metrics import EngineStats
from inference_service.engine.request import Delta, Request, RequestOutput
from inference_service.engine.snapshot import AdapterState

__all__ = ["AdapterState", "Delta", "Engine", "EngineConfig", "EngineStats", "Request", "RequestOutput"]
