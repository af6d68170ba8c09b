"""Domain errors, one class per gRPC status they map to.

Code raises these with a message naming the thing at fault; the gRPC layer maps the class to a
status code in one place, so no module below it imports grpc.
"""


class LoramuxError(Exception):
    """Base of every error a user can act on."""


class InvalidArgument(LoramuxError):
    """Malformed request or checkpoint, bad sampling values, rank > max, shape mismatch."""


class NotFound(LoramuxError):
    """Unknown adapter or file."""


class AlreadyExists(LoramuxError):
    """Adapter exists with different content."""


class FailedPrecondition(LoramuxError):
    """Adapter incompatible with the base model; delete of a pinned adapter without force."""


class ResourceExhausted(LoramuxError):
    """Admission queue full."""


class Unavailable(LoramuxError):
    """Store unreachable, shutting down, not ready."""


class PermissionDenied(LoramuxError):
    """Wrong token, source outside the allowed roots, bucket not allowed."""


class Unauthenticated(LoramuxError):
    """Missing token."""


def quoted(text: object, limit: int = 80) -> str:
    """Untrusted text (a digest or message from another process) as it may appear in an error
    message: repr-escaped, so control characters cannot forge log lines, and cut to `limit`."""
    text = str(text)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


CAUSE_CHARS = 300  # of an exception's text quoted to a client: enough to name it, never a dump


def brief(error: Exception) -> str:
    """An unexpected exception named in one line, short enough to quote in a status message."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."
