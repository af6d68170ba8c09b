"""StoreMetrics: the adapter store's Prometheus series, in one registry per process.

Calls are counted by an interceptor that sits outside every other (so refusals by the token checks
count too); the catalog's gauges are read from one snapshot per scrape; the servicer makes one call
per fetched chunk and nothing else."""

import asyncio
import logging
import time
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from adapter_store.store import Store
from shared.errors import LoramuxError

log = logging.getLogger(__name__)
# Seconds. Admin reads answer in milliseconds; a registration fetches, validates and optimizes a
# checkpoint, from a disk or from S3, in up to minutes.
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class StoreMetrics:
    """The series of one store process, in `registry`, for the calls of `service`."""

    def __init__(self, registry: CollectorRegistry, store: Store, service: str):
        self.registry, self.service = registry, service
        self.rpcs = Counter(
            "loramux_store_rpcs",
            "Calls by method and the gRPC status they ended with",
            ["method", "code"],
            registry=registry,
        )
        self.rpc_seconds = Histogram(
            "loramux_store_rpc_duration_seconds",
            "Seconds to answer calls answered with one message (every admin RPC, and refusals), by method",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self.fetch_bytes = Counter(
            "loramux_store_fetch_bytes", "Blob bytes FetchAdapter streams sent", registry=registry
        )
        registry.register(CatalogCollector(store))
        ProcessCollector(registry=registry)

    def sent(self, chunk: bytes) -> None:
        """A FetchAdapter chunk is about to go out."""
        self.fetch_bytes.inc(len(chunk))

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return RpcMetricsInterceptor(self)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts each call of the store's service by method and final status; times unary answers."""

    def __init__(self, metrics: StoreMetrics):
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service, _, method = details.method.rpartition("/")
        if handler is None or service != f"/{self._metrics.service}":
            return handler  # health and reflection: not the store's own calls
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler

    def _unary(self, behavior, method: str):
        async def call(request, context):
            start = time.perf_counter()
            try:
                response = await behavior(request, context)
            except BaseException as e:
                self._count(method, _code(e, context))
                raise
            finally:
                self._metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)
            self._count(method, context.code() or grpc.StatusCode.OK)
            return response

        return call

    def _stream(self, behavior, method: str):
        async def call(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as e:
                self._count(method, _code(e, context))
                raise
            self._count(method, context.code() or grpc.StatusCode.OK)

        return call

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self._metrics.rpcs.labels(method, code.name).inc()


def _code(error: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call ended by `error` gets: the one it aborted with (every domain error is
    turned into an abort inside), CANCELLED when the caller left, else what gRPC makes of a bug."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return context.code() or grpc.StatusCode.UNKNOWN


class CatalogCollector(Collector):
    """The catalog's size, pins and blob bytes, and the live watch streams, read at each scrape."""

    def __init__(self, store: Store):
        self._store = store

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "loramux_store_watch_streams",
            "WatchAdapters streams open (workers following the catalog)",
            self._store.events.watchers,
        )
        try:
            records = self._store.snapshot()
        except LoramuxError as e:  # a shared catalog's S3 is down: every other series still goes out
            log.warning("the catalog gauges are left out of this scrape: %s", e)
            return
        blob_bytes = {r.digest: r.size_bytes for r in records}  # blobs are shared by digest
        yield GaugeMetricFamily("loramux_store_adapters", "Adapters registered", len(records))
        yield GaugeMetricFamily(
            "loramux_store_adapters_pinned",
            "Registered adapters that are pinned",
            sum(r.pinned for r in records),
        )
        yield GaugeMetricFamily(
            "loramux_store_blob_bytes",
            "Bytes of the optimized blobs kept (each digest once)",
            sum(blob_bytes.values()),
        )
