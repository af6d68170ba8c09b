"""What both gRPC services share: domain errors mapped to status codes in one place, bearer-token
checks, the listening port (plaintext or TLS), and the standard health and reflection services."""

import asyncio
import hmac
import inspect
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from shared import errors
from shared.tls import ServerTls

log = logging.getLogger(__name__)
# Pings on idle connections: both servers and the worker's channel to its store notice a dead
# peer in ~40 s instead of at the next write.
KEEPALIVE = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_of(error: errors.LoramuxError) -> grpc.StatusCode:
    """The status of the most specific mapped class; INTERNAL for a bare LoramuxError."""
    return next((STATUS[c] for c in type(error).__mro__ if c in STATUS), grpc.StatusCode.INTERNAL)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose handler raised a LoramuxError with the matching status and its message;
    anything else is a bug: logged with its traceback, INTERNAL for the caller."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, details.method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream, details.method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


def _unary(behavior, method: str):
    async def call(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except errors.LoramuxError as e:
            await context.abort(status_of(e), str(e))
        except Exception:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")

    return call


def _stream(behavior, method: str):
    async def call(request, context):
        try:
            responses = behavior(request, context)
            if inspect.isawaitable(responses):  # a handler that sends with context.write (health Watch)
                await responses
                return
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except errors.LoramuxError as e:
            await context.abort(status_of(e), str(e))
        except Exception:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")

    return call


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires "authorization: Bearer <token>" on the given methods (full names,
    "/package.Service/Method"): UNAUTHENTICATED when absent, PERMISSION_DENIED when wrong."""

    def __init__(self, token: str, methods: Iterable[str]):
        self._expected = f"Bearer {token}".encode()
        self._methods = frozenset(methods)

    async def intercept_service(self, continuation, details):
        if details.method not in self._methods:
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization")
        # compare_digest takes as long whatever the bytes, so timing cannot spell the token out.
        if sent is not None and hmac.compare_digest(_bytes(sent), self._expected):
            return await continuation(details)
        if sent is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, f"{details.method} needs a bearer token")
        return _deny(grpc.StatusCode.PERMISSION_DENIED, f"{details.method}: the bearer token is wrong")


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(deny)


def add_port(server: grpc.aio.Server, listen: str, tls: ServerTls | None) -> int:
    """Listen on `listen` (HOST:PORT), over TLS when `tls` is given; returns the port bound."""
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.credentials())
    if port == 0:
        raise errors.InvalidArgument(f"cannot listen on {listen}")
    return port


async def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> HealthServicer:
    """grpc.health.v1 (every name in service_names plus "" reported SERVING) and reflection."""
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    return health


async def until_signal() -> None:
    """Returns on SIGTERM or SIGINT: where a server starts its shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
