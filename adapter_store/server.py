"""Run the adapter store: the gRPC server with its interceptors, health and reflection, until a
signal stops it."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry

from adapter_store.config import StoreConfig
from adapter_store.prometheus_metrics import StoreMetrics
from adapter_store.servicer import ADMIN_METHODS, SERVICE, WORKER_METHODS, AdapterStoreServicer
from adapter_store.store import Store
from shared.grpc_server import (
    KEEPALIVE,
    ErrorInterceptor,
    TokenInterceptor,
    add_health_and_reflection,
    add_port,
    until_signal,
)
from shared.metrics_endpoint import MetricsEndpoint
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 4 << 20  # fetch chunks are 1 MiB; nothing else comes close
GRACE_S = 5.0
UNWIND_S = 1.0  # for the tasks of calls the stop ended (a cancelled watch) to finish


async def serve(config: StoreConfig) -> None:
    store = Store(config)
    metrics = StoreMetrics(CollectorRegistry(), store, SERVICE)
    server = grpc.aio.server(
        interceptors=[metrics.interceptor(), *_interceptors(config)],  # counts refusals too
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *KEEPALIVE,
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    with ThreadPoolExecutor(8, thread_name_prefix="store") as executor:
        pb_grpc.add_AdapterStoreServicer_to_server(AdapterStoreServicer(store, executor, metrics), server)
        health = await add_health_and_reflection(server, [SERVICE])
        port = add_port(server, config.listen, config.tls)
        await server.start()
        host = config.listen.rsplit(":", 1)[0]
        print(f"adapter store listening on {host}:{port}", flush=True)
        endpoint = MetricsEndpoint(config.metrics_listen, metrics.registry) if config.metrics_listen else None
        await until_signal()
        log.info("stopping: new calls are refused, calls in flight get %.0f s", GRACE_S)
        await health.enter_graceful_shutdown()
        await server.stop(GRACE_S)
        await _calls_unwound(UNWIND_S)
        if endpoint is not None:
            endpoint.close()  # before the catalog it reads closes
    store.close()


async def _calls_unwound(timeout_s: float) -> None:
    """grpc's stop returns once core has ended every call, not once the tasks running them have
    unwound: a watch stream never ends by itself, so at a stop its handler is still being
    cancelled. Returning then would let uvloop.run cancel grpc's task awaiting that handler,
    which grpc logs as "Exception not handled by _handle_exceptions" with a CancelledError."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout_s)


def _interceptors(config: StoreConfig) -> list[grpc.aio.ServerInterceptor]:
    """Token checks first, each on its own methods (admin RPCs; the workers' fetch and watch);
    health and reflection stay open."""
    interceptors = []
    if config.admin_token:
        interceptors.append(TokenInterceptor(config.admin_token, ADMIN_METHODS))
    if config.worker_token:
        interceptors.append(TokenInterceptor(config.worker_token, WORKER_METHODS))
    return [*interceptors, ErrorInterceptor()]
