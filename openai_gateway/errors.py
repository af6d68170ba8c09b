"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the HTTP status
each SDK error (a gRPC status) becomes."""

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from loramux import LoramuxError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
UNION_TAGS = {"str", "int", "float", "bool"}
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """An HTTP error to answer with: status, message, and the request parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_sdk(cls, error: LoramuxError, param: str | None = None) -> "ApiError":
        return cls(HTTP_STATUS.get(error.code, 500), error.message, param, error.code.name.lower())

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def invalid_body(error: ValidationError) -> ApiError:
    """What is wrong with a body, naming its parameter as a dotted path (messages.0.role). Of a
    union's errors, the one that got furthest into the value says most (an image part is a list
    entry whose type is not "text", rather than "not a string"); at equal depth, one about a value
    of the right type (token id 2**70 is past int32, rather than "not a string")."""
    deepest = max(error.errors(include_url=False), key=lambda e: (len(e["loc"]), _right_type(e)))
    param = ".".join(str(part) for part in deepest["loc"] if not _union_tag(part)) or None
    return ApiError(400, f"{param or 'body'}: {deepest['msg']}", param)


def _right_type(error: dict) -> bool:
    return not error["type"].endswith("_type")


def _union_tag(part: str | int) -> bool:
    """pydantic names the union member an error is for inside the location (str, list[int], TextPart)."""
    return isinstance(part, str) and (part in UNION_TAGS or "[" in part or part[:1].isupper())


async def api_error_handler(_: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def sdk_error_handler(_: Request, error: LoramuxError) -> JSONResponse:
    return ApiError.from_sdk(error).response()


async def http_error_handler(_: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method, 413 body too large) in OpenAI's shape."""
    return ApiError(error.status_code, str(error.detail)).response()


HANDLERS = {ApiError: api_error_handler, LoramuxError: sdk_error_handler, HTTPException: http_error_handler}
