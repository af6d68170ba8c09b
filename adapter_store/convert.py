"""Proto <-> domain conversion for the AdapterStore service, in one place."""

import base64

from google.protobuf.timestamp_pb2 import Timestamp

from adapter_store.catalog import AdapterRecord
from adapter_store.events import CatalogEvent
from shared import adapter_blob
from shared.errors import InvalidArgument
from shared.names import ADAPTER_ID
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb

EVENT_TYPES = {
    "registered": pb.AdapterEvent.TYPE_REGISTERED,
    "deleted": pb.AdapterEvent.TYPE_DELETED,
    "pinned": pb.AdapterEvent.TYPE_PINNED,
    "unpinned": pb.AdapterEvent.TYPE_UNPINNED,
}
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000


def adapter(record: AdapterRecord) -> pb.Adapter:
    created = Timestamp()
    created.FromNanoseconds(int(record.created_at * 1e9))
    return pb.Adapter(
        adapter_id=record.adapter_id,
        digest=record.digest,
        rank=record.rank,
        alpha=record.alpha,
        target_modules=record.target_modules,
        size_bytes=record.size_bytes,
        dtype=record.dtype,
        source_uri=record.source_uri,
        pinned=record.pinned,
        create_time=created,
        state=pb.ADAPTER_STATE_READY,
    )


def event(change: CatalogEvent) -> pb.AdapterEvent:
    return pb.AdapterEvent(type=EVENT_TYPES[change.kind], adapter=adapter(change.record))


def existing(record: AdapterRecord) -> pb.AdapterEvent:
    return pb.AdapterEvent(type=pb.AdapterEvent.TYPE_EXISTING, adapter=adapter(record))


def header(digest: str, size: int, offset: int, info: adapter_blob.BlobInfo) -> pb.FetchAdapterResponse:
    return pb.FetchAdapterResponse(
        header=pb.BlobHeader(
            digest=digest,
            size_bytes=size,
            rank=info.rank,
            target_modules=info.target_modules,
            tensors=[pb.TensorInfo(name=t.name, shape=t.shape, dtype=t.dtype) for t in info.tensors],
            dtype=info.dtype,
            offset=offset,
        )
    )


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument(f"page_size must not be negative, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def page_token(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode()


def after_id(token: str) -> str | None:
    """The last adapter id of the previous page, from its opaque token."""
    if not token:
        return None
    try:
        last_id = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        last_id = ""
    if not ADAPTER_ID.fullmatch(last_id):
        raise InvalidArgument(f"page_token {token!r} is not one this store issued")
    return last_id
