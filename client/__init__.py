"""The loramux Python SDK: generate with many LoRA adapters on a worker, manage them in the store.

import loramux
with loramux.Client(worker="127.0.0.1:50051", store="127.0.0.1:50061") as client:
    for delta in client.generate("Hello", adapter="legal", max_tokens=32):
        print(delta.text, end="")
"""

from .async_client import AsyncClient
from .errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LoramuxError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .stream import AsyncStream, Stream
from .sync_client import Client
from .types import Adapter, Completion, Delta, ModelInfo, TokenLogprob, TopLogprob, WorkerAdapter

__all__ = [
    "Adapter",
    "AlreadyExists",
    "AsyncClient",
    "AsyncStream",
    "Cancelled",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "Delta",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "LoramuxError",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Stream",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "WorkerAdapter",
]
