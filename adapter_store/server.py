"""Run the adapter store: the gRPC server with its interceptors, health and reflection, until a
signal stops it."""

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from adapter_store.config import StoreConfig
from adapter_store.servicer import ADMIN_METHODS, SERVICE, AdapterStoreServicer
from adapter_store.store import Store
from shared.errors import InvalidArgument
from shared.grpc_server import ErrorInterceptor, TokenInterceptor, add_health_and_reflection, until_signal
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 4 << 20  # fetch chunks are 1 MiB; nothing else comes close
GRACE_S = 5.0


async def serve(config: StoreConfig) -> None:
    store = Store(config)
    interceptors = [ErrorInterceptor()]
    if config.admin_token:
        interceptors.insert(0, TokenInterceptor(config.admin_token, ADMIN_METHODS))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    with ThreadPoolExecutor(8, thread_name_prefix="store") as executor:
        pb_grpc.add_AdapterStoreServicer_to_server(AdapterStoreServicer(store, executor), server)
        health = await add_health_and_reflection(server, [SERVICE])
        port = server.add_insecure_port(config.listen)
        if port == 0:
            raise InvalidArgument(f"cannot listen on {config.listen}")
        await server.start()
        host = config.listen.rsplit(":", 1)[0]
        print(f"adapter store listening on {host}:{port}", flush=True)
        await until_signal()
        log.info("stopping: new calls are refused, calls in flight get %.0f s", GRACE_S)
        await health.enter_graceful_shutdown()
        await server.stop(GRACE_S)
    store.close()
