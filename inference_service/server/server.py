"""Run an inference worker: gRPC server first (liveness), then the model (readiness), the
adapter store link, and on SIGTERM a drain: readiness off, new calls refused, streams in flight
finish within the drain timeout, then exit 0. If the engine dies instead, every health service
turns NOT_SERVING, its streams have already ended with UNAVAILABLE, and the worker exits 1 for a
supervisor to restart it."""

import asyncio
import logging
import os

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from inference_service.adapters.store_channel import open_store_channel
from inference_service.adapters.store_loader import StoreAdapterLoader
from inference_service.engine import Engine
from inference_service.model.shard import Shard
from inference_service.server.admission import Admission
from inference_service.server.prometheus_metrics import WorkerMetrics
from inference_service.server.servicer import SERVICE, InferenceServicer
from inference_service.server.store_watch import StoreWatch
from inference_service.server.worker_config import WorkerConfig
from shared.grpc_server import (
    KEEPALIVE,
    ErrorInterceptor,
    TokenInterceptor,
    add_health_and_reflection,
    add_port,
    until_signal,
)
from shared.metrics_endpoint import MetricsEndpoint
from shared.model_config import ModelConfig
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
FAILURE_GRACE_S = 0.5  # for streams to send the status that ends them once the engine died
MAX_MESSAGE_BYTES = 16 << 20  # what the worker sends
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM (then return) or an engine failure (then exit the process with 1)."""
    admission = Admission(config.max_pending)
    metrics = WorkerMetrics(CollectorRegistry(), admission)
    servicer = InferenceServicer(admission, metrics)
    server, health = await _start_server(config, servicer)
    endpoint = MetricsEndpoint(config.metrics_listen, metrics.registry) if config.metrics_listen else None
    await health.set("readiness", NOT_SERVING)
    await health.set(SERVICE, NOT_SERVING)
    store = open_store_channel(config.store, config.store_tls, config.store_token) if config.store else None
    try:
        engine, watch = await asyncio.to_thread(_build_engine, config, store)
    except BaseException:  # a model or cache that cannot serve: nothing left running behind
        await server.stop(0)
        for closable in (endpoint, store):
            if closable is not None:
                closable.close()
        raise
    failed = _engine_failure(engine)
    servicer.engine = engine
    metrics.watch_engine(engine)
    await health.set("readiness", SERVING)
    await health.set(SERVICE, SERVING)
    log.info("ready: model %s, %s", config.engine.model, f"store {config.store}" if store else "no store")
    signalled = asyncio.ensure_future(until_signal())
    await asyncio.wait([signalled, failed], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if failed.done():
        await _shut_after_failure(failed.result(), server, health, admission)
        _exit_now(1)
    await _drain(config, server, health, admission, engine)
    if watch is not None:
        watch.stop()
    if store is not None:
        store.close()
    if endpoint is not None:
        endpoint.close()


def _engine_failure(engine: Engine) -> asyncio.Future:
    """Resolves with the engine's error if its thread dies."""
    loop = asyncio.get_running_loop()
    failed = loop.create_future()
    engine.on_fatal(lambda error: loop.call_soon_threadsafe(failed.set_result, error))
    return failed


async def _start_server(config: WorkerConfig, servicer: InferenceServicer):
    interceptors = [ErrorInterceptor()]
    if config.api_token:
        interceptors.insert(0, TokenInterceptor(config.api_token, [f"/{SERVICE}/Generate"]))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            *KEEPALIVE,
            ("grpc.max_receive_message_length", config.max_message_bytes),  # RESOURCE_EXHAUSTED beyond
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    health = await add_health_and_reflection(server, [SERVICE, "liveness", "readiness"])
    port = add_port(server, config.listen, config.tls)
    await server.start()
    print(f"inference worker listening on {config.listen.rsplit(':', 1)[0]}:{port}", flush=True)
    return server, health


def _build_engine(config: WorkerConfig, store: grpc.Channel | None) -> tuple[Engine, StoreWatch | None]:
    if store is None:
        engine = Engine(config.engine)
        engine.start()
        return engine, None
    e = config.engine
    model = ModelConfig.from_dir(e.model)
    limits = config.fetch.for_model(model, e.max_lora_rank)
    shard = Shard(0, e.tensor_parallel_size, e.fully_sharded_loras)  # this process is rank 0
    loader = StoreAdapterLoader(store, config.cache_dir, model, e.max_lora_rank, e.torch_dtype, limits, shard)
    engine = Engine(e, loader)
    engine.start()
    watch = StoreWatch(store, engine, loader)
    watch.start()
    return engine, watch


async def _shut_after_failure(error: Exception, server, health, admission: Admission) -> None:
    """The engine ended every stream with UNAVAILABLE; let those statuses reach their callers."""
    log.error("shutting down after an engine failure: %s", error)
    admission.close(str(error))
    await health.enter_graceful_shutdown()  # every service NOT_SERVING, for good
    await admission.drained(FAILURE_GRACE_S)
    await server.stop(FAILURE_GRACE_S)


def _exit_now(status: int) -> None:
    """Exit without joining threads: a hung step, and any snapshot waiting on its lock, never end."""
    logging.shutdown()
    os._exit(status)


async def _drain(config, server, health, admission: Admission, engine: Engine) -> None:
    log.info("draining: new calls are refused, streams in flight get %.0f s", config.drain_timeout_s)
    admission.close()
    await health.enter_graceful_shutdown()
    if not await admission.drained(config.drain_timeout_s):
        log.warning("drain timeout: aborting %d streams", admission.in_flight)
        engine.abort_all()
        await admission.drained(5.0)
    await server.stop(1.0)
    await asyncio.to_thread(engine.stop)
