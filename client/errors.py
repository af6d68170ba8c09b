"""Errors the SDK raises: one class per gRPC status the loramux services use.

Every failed RPC, including one that fails mid-stream, surfaces as a LoramuxError whose class names
the status, so callers catch `loramux.NotFound` rather than inspecting grpc.RpcError.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class LoramuxError(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.message` the service's explanation."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(LoramuxError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LoramuxError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LoramuxError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LoramuxError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LoramuxError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(LoramuxError):
    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(LoramuxError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(LoramuxError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(LoramuxError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LoramuxError):
    code = grpc.StatusCode.CANCELLED


class Internal(LoramuxError):
    code = grpc.StatusCode.INTERNAL


ERROR_CLASSES = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        PermissionDenied,
        Unauthenticated,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


# How gRPC words a stream the peer reset with HTTP/2 INTERNAL_ERROR instead of ending it with a
# status: nginx resets the calls in flight on a worker that died (deploy/nginx/loramux.conf).
STREAM_RESET = "Received RST_STREAM with error code 2"


def from_rpc_error(error: grpc.RpcError) -> LoramuxError:
    """The LoramuxError subclass for the status `error` carries (the base class for other codes).
    A reset stream is Unavailable, as a broken connection to the worker is: no server gave it a
    status (gRPC says INTERNAL), and the call may succeed when retried."""
    # Sync errors are grpc.Call, grpc.aio.AioRpcError is not; both have code() and details().
    has_status = callable(getattr(error, "code", None))
    code = error.code() if has_status else grpc.StatusCode.UNKNOWN
    message = (error.details() if has_status else None) or str(error)
    if code == grpc.StatusCode.INTERNAL and STREAM_RESET in message:
        code = grpc.StatusCode.UNAVAILABLE
        message = f"the call was reset in flight, its worker gone: {message}"
    return ERROR_CLASSES.get(code, LoramuxError)(message, code)


@contextmanager
def rpc_errors() -> Iterator[None]:
    """Re-raises a grpc.RpcError inside the block as the matching LoramuxError."""
    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
