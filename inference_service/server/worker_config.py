"""WorkerConfig: the one configuration of an inference worker process (the engine's plus serving)."""

from dataclasses import dataclass, field
from pathlib import Path

from inference_service.adapters.blob_fetch import FetchLimits
from inference_service.engine.config import EngineConfig
from shared.errors import InvalidArgument

# 4 MiB, gRPC's own default: a 128k-token prompt as token ids (5 bytes each at most) or as real text
# (about 4 bytes a token) fits several times over. A larger message is dropped by gRPC before Python
# parses it; one that gets in costs the event loop a parse (15 MB: ~100 ms, a visible stall of other
# streams, measured by bench.hostile_prompt). Each admitted Generate call can hold one message, so
# max_pending × this bounds what requests hold in memory before they are tokenized.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
MIN_MESSAGE_BYTES = 1 << 10  # below this not even a short chat prompt fits
GRPC_MESSAGE_LIMIT = (1 << 31) - 1  # gRPC keeps message sizes in a signed 32-bit int


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    cache_dir: Path  # fetched adapter blobs, by digest
    listen: str = "127.0.0.1:50051"
    store: str | None = None  # adapter store HOST:PORT; None = no adapters
    api_token: str | None = None  # when set, Generate needs "authorization: Bearer <token>"
    max_pending: int = 256  # Generate calls held at once (running and queued)
    drain_timeout_s: float = 30.0  # after SIGTERM, how long streams in flight may take
    # The largest request message gRPC takes in; anything longer is refused before it is decoded.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    fetch: FetchLimits = field(default_factory=FetchLimits)  # bytes and seconds one adapter fetch may take

    def __post_init__(self):
        if self.max_pending < 1:
            raise InvalidArgument(f"max_pending must be at least 1, got {self.max_pending}")
        if self.drain_timeout_s < 0:
            raise InvalidArgument(f"drain_timeout_s must not be negative, got {self.drain_timeout_s}")
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= GRPC_MESSAGE_LIMIT:
            raise InvalidArgument(
                f"max_message_bytes must be in [{MIN_MESSAGE_BYTES}, {GRPC_MESSAGE_LIMIT}], "
                f"got {self.max_message_bytes}"
            )
