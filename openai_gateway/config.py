"""GatewayConfig: the one configuration of a gateway process."""

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 4 << 20  # the worker's own request message limit: a larger prompt fails there anyway
MAX_N = 16  # samples one request may ask for; each is a Generate call of its own
# Generate calls (prompts × n) one request may start. OpenAI caps n alone at 128; at half the
# worker's default --max-pending (256), one request cannot fill the worker's admission by itself.
DEFAULT_MAX_GENERATIONS = 128


@dataclass(frozen=True)
class UpstreamTls:
    """The SDK's TLS files for the worker and store channels (see loramux.AsyncClient)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class HttpsFiles:
    """uvicorn's TLS files for the gateway's own HTTPS; with `client_ca`, clients need its certificates."""

    certfile: Path
    keyfile: Path
    client_ca: Path | None = None


@dataclass(frozen=True)
class GatewayConfig:
    worker: str = "127.0.0.1:50051"  # HOST:PORT of a worker, or of a router in front of several
    store: str = "127.0.0.1:50061"  # HOST:PORT of the adapter store
    listen: str = "127.0.0.1:8000"
    served_model_name: str | None = None  # the base model's name in the API; None = the worker's model name
    api_key: str | None = field(default=None, repr=False)  # when set, every /v1 route needs it as Bearer
    admin_token: str | None = field(default=None, repr=False)  # load/unload need it; sent to the store
    worker_token: str | None = field(default=None, repr=False)  # sent to the worker as its api token
    upstream_tls: UpstreamTls = field(default_factory=UpstreamTls)
    https: HttpsFiles | None = None  # None: plain HTTP
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_generations_per_request: int = DEFAULT_MAX_GENERATIONS  # prompts × n; more is a 400
    timeout_s: float | None = None  # deadline of each gRPC call; None = none
    drain_timeout_s: float = 30.0  # after SIGTERM, how long requests in flight may take

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_generations_per_request < 1:
            raise ValueError(
                f"max_generations_per_request must be at least 1, got {self.max_generations_per_request}"
            )
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must not be negative, got {self.drain_timeout_s}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
