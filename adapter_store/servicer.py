"""The AdapterStore gRPC servicer: each method decodes, calls the Store, encodes."""

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from adapter_store import convert
from adapter_store.prometheus_metrics import StoreMetrics
from adapter_store.store import Store
from shared.errors import InvalidArgument
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
SERVICE = pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name
ADMIN_METHODS = tuple(
    f"/{SERVICE}/{m}"
    for m in ("RegisterAdapter", "GetAdapter", "ListAdapters", "DeleteAdapter", "PinAdapter", "UnpinAdapter")
)
WORKER_METHODS = tuple(f"/{SERVICE}/{m}" for m in ("FetchAdapter", "WatchAdapters"))  # --worker-token


class AdapterStoreServicer(pb_grpc.AdapterStoreServicer):
    def __init__(self, store: Store, executor: ThreadPoolExecutor, metrics: StoreMetrics):
        self.store = store
        self._executor, self._metrics = executor, metrics

    async def _run(self, fn, *args):
        """Blocking Store calls (disk, S3, validation) run off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def RegisterAdapter(self, request, context):
        log.info("register %r from %s (%s)", request.adapter_id, request.source_uri, request.request_id)
        record, created = await self._run(self.store.register, request.adapter_id, request.source_uri)
        log.info("%s %r as %s", "registered" if created else "unchanged", record.adapter_id, record.digest)
        return convert.adapter(record)

    async def GetAdapter(self, request, context):
        return convert.adapter(await self._run(self.store.get, request.adapter_id))

    async def ListAdapters(self, request, context):
        size = convert.page_size(request.page_size)
        records = await self._run(self.store.page, size + 1, convert.after_id(request.page_token))
        page = records[:size]
        more = len(records) > size
        return pb.ListAdaptersResponse(
            adapters=[convert.adapter(r) for r in page],
            next_page_token=convert.page_token(page[-1].adapter_id) if more else "",
        )

    async def DeleteAdapter(self, request, context):
        record = await self._run(self.store.delete, request.adapter_id, request.force)
        return pb.DeleteAdapterResponse(adapter=convert.adapter(record))

    async def PinAdapter(self, request, context):
        return convert.adapter(await self._run(self.store.set_pinned, request.adapter_id, True))

    async def UnpinAdapter(self, request, context):
        return convert.adapter(await self._run(self.store.set_pinned, request.adapter_id, False))

    async def FetchAdapter(self, request, context):
        blob, digest = await self._run(self.store.open_blob, request.adapter_id, request.digest)
        with blob:
            size = os.fstat(blob.fileno()).st_size
            if not 0 <= request.offset <= size:
                raise InvalidArgument(f"offset {request.offset} is outside blob {digest} of {size} bytes")
            yield convert.header(digest, size, request.offset, await self._run(self.store.blob_info, blob))
            blob.seek(request.offset)
            while chunk := await self._run(blob.read, CHUNK_BYTES):
                self._metrics.sent(chunk)
                yield pb.FetchAdapterResponse(chunk=chunk)

    async def WatchAdapters(self, request, context):
        subscription = self.store.subscribe()
        try:
            for record in await self._run(self.store.snapshot):
                yield convert.existing(record)
            yield pb.AdapterEvent(type=pb.AdapterEvent.TYPE_SYNCED)
            async for change in subscription:
                yield convert.event(change)
        finally:
            subscription.close()
