"""WorkerConfig: the one configuration of an inference worker process (the engine's plus serving)."""

from dataclasses import dataclass, field
from pathlib import Path

from inference_service.blob_fetch import FetchLimits
from inference_service.config import EngineConfig
from shared.errors import InvalidArgument


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    cache_dir: Path  # fetched adapter blobs, by digest
    listen: str = "127.0.0.1:50051"
    store: str | None = None  # adapter store HOST:PORT; None = no adapters
    api_token: str | None = None  # when set, Generate needs "authorization: Bearer <token>"
    max_pending: int = 256  # Generate calls held at once (running and queued)
    drain_timeout_s: float = 30.0  # after SIGTERM, how long streams in flight may take
    fetch: FetchLimits = field(default_factory=FetchLimits)  # bytes and seconds one adapter fetch may take

    def __post_init__(self):
        if self.max_pending < 1:
            raise InvalidArgument(f"max_pending must be at least 1, got {self.max_pending}")
        if self.drain_timeout_s < 0:
            raise InvalidArgument(f"drain_timeout_s must not be negative, got {self.drain_timeout_s}")
