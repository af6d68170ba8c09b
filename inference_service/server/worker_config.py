"""WorkerConfig: the one configuration of an inference worker process (the engine's plus serving)."""

from dataclasses import dataclass, field
from pathlib import Path

from inference_service.adapters.blob_fetch import FetchLimits
from inference_service.engine.config import EngineConfig
from shared.errors import InvalidArgument
from shared.metrics_endpoint import metrics_address
from shared.tls import ChannelTls, ServerTls

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
    tls: ServerTls | None = None  # None: plaintext; with a client CA, clients need its certificates
    store_tls: ChannelTls | None = None  # None: a plaintext channel to the store
    store_token: str | None = None  # sent as a bearer token on FetchAdapter and WatchAdapters
    max_pending: int = 256  # Generate calls held at once (running and queued)
    drain_timeout_s: float = 30.0  # after SIGTERM, how long streams in flight may take
    # The largest request message gRPC takes in; anything longer is refused before it is decoded.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    fetch: FetchLimits = field(default_factory=FetchLimits)  # bytes and seconds one adapter fetch may take
    metrics_listen: str | None = None  # HOST:PORT serving Prometheus /metrics; None = not served

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
        if self.metrics_listen is not None:
            metrics_address(self.metrics_listen)  # refuses anything but HOST:PORT, naming it
