"""request_log: one log line per Generate call, under the worker's own id for the request and the
caller's request_id (a label of the caller's, so their report and this log can be matched)."""

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared.errors import LoramuxError, quoted
from shared.grpc_server import status_of

log = logging.getLogger(__name__)


@contextmanager
def request_log(worker_request_id: str, label: str, adapter: str) -> Iterator[None]:
    """A call that ends in an error or is cancelled logs at INFO, naming the status and cause; one
    that finishes logs at DEBUG. The caller's strings are quoted, so they cannot forge lines."""
    start = time.perf_counter()
    who = f"request {worker_request_id} (request_id {quoted(label)}, adapter {quoted(adapter or '')})"
    try:
        yield
    except LoramuxError as e:
        log.info("%s ended with %s after %.2f s: %s", who, status_of(e).name, _since(start), e)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        log.info("%s was cancelled by its caller after %.2f s", who, _since(start))
        raise
    log.debug("%s finished in %.2f s", who, _since(start))


def _since(start: float) -> float:
    return time.perf_counter() - start
