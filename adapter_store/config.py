"""StoreConfig: the one configuration of an adapter store process."""

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.blob_limit import default_max_adapter_bytes
from shared.dtypes import DTYPES
from shared.errors import InvalidArgument
from shared.metrics_endpoint import metrics_address
from shared.model_config import ModelConfig
from shared.tls import ServerTls


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path  # blobs/ and catalog.sqlite live here
    listen: str = "127.0.0.1:50061"
    allowed_roots: tuple[Path, ...] = ()  # file:// sources must resolve inside one of these
    s3_endpoint: str | None = None  # None: boto3's default (AWS, or AWS_ENDPOINT_URL)
    s3_allowed_buckets: tuple[str, ...] = ()  # s3:// sources must name one of these
    admin_token: str | None = None  # when set, admin RPCs need "authorization: Bearer <token>"
    worker_token: str | None = None  # when set, FetchAdapter and WatchAdapters need it as a bearer token
    tls: ServerTls | None = None  # None: plaintext; with a client CA, clients need its certificates
    base_model: Path | None = None  # HF model folder whose config.json adapters are checked against
    dtype: str = "float32"  # serving dtype of optimized blobs
    max_lora_rank: int = 64
    # Per source file; 0: the largest an adapter of max_lora_rank on base_model can be, at least
    # 1 GiB (shared/blob_limit.py), which __post_init__ puts here.
    max_adapter_bytes: int = 0
    s3_timeout_s: float = 30.0  # connect and read timeout of one S3 call
    catalog: str | None = None  # s3://bucket/prefix shared with other stores; None: SQLite in data_dir
    catalog_poll_s: float = 2.0  # how often other stores' changes are looked for: the watch lag
    metrics_listen: str | None = None  # HOST:PORT serving Prometheus /metrics; None = not served

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.max_lora_rank < 1:
            raise InvalidArgument(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_adapter_bytes < 0:
            raise InvalidArgument(f"max_adapter_bytes must not be negative, got {self.max_adapter_bytes}")
        if self.s3_timeout_s <= 0:
            raise InvalidArgument(f"s3_timeout_s must be positive, got {self.s3_timeout_s}")
        if self.catalog_poll_s <= 0:
            raise InvalidArgument(f"catalog_poll_s must be positive, got {self.catalog_poll_s}")
        bucket = (self.catalog or "").removeprefix("s3://").partition("/")[0]
        if self.catalog is not None and not (self.catalog.startswith("s3://") and bucket):
            raise InvalidArgument(f"catalog {self.catalog!r} is not s3://bucket/prefix")
        if self.base_model is not None and not (Path(self.base_model) / "config.json").is_file():
            raise InvalidArgument(f"base model folder {self.base_model} has no config.json")
        if self.metrics_listen is not None:
            metrics_address(self.metrics_listen)  # refuses anything but HOST:PORT, naming it
        if not self.max_adapter_bytes:
            model = ModelConfig.from_dir(self.base_model) if self.base_model else None
            limit = default_max_adapter_bytes(model, self.max_lora_rank)
            object.__setattr__(self, "max_adapter_bytes", limit)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
