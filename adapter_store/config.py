"""StoreConfig: the one configuration of an adapter store process."""

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.dtypes import DTYPES
from shared.errors import InvalidArgument


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path  # blobs/ and catalog.sqlite live here
    listen: str = "127.0.0.1:50061"
    allowed_roots: tuple[Path, ...] = ()  # file:// sources must resolve inside one of these
    s3_endpoint: str | None = None  # None: boto3's default (AWS, or AWS_ENDPOINT_URL)
    s3_allowed_buckets: tuple[str, ...] = ()  # s3:// sources must name one of these
    admin_token: str | None = None  # when set, admin RPCs need "authorization: Bearer <token>"
    base_model: Path | None = None  # HF model folder whose config.json adapters are checked against
    dtype: str = "float32"  # serving dtype of optimized blobs
    max_lora_rank: int = 64
    max_adapter_bytes: int = 1 << 30  # per source file
    s3_timeout_s: float = 30.0  # connect and read timeout of one S3 call

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        for name in ("max_lora_rank", "max_adapter_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.s3_timeout_s <= 0:
            raise InvalidArgument(f"s3_timeout_s must be positive, got {self.s3_timeout_s}")
        if self.base_model is not None and not (Path(self.base_model) / "config.json").is_file():
            raise InvalidArgument(f"base model folder {self.base_model} has no config.json")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
