"""request_log: one log line per Generate call, under the worker's own id for the request and the
caller's request_id (a label of the caller's, so their report and this log can be matched); a
storm of cancels, one line a window with their count."""

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared.errors import LoramuxError, quoted
from shared.grpc_server import status_of

log = logging.getLogger(__name__)

CANCEL_WINDOW_S = 10.0


class CancelLog:
    """Cancelled calls at INFO, one line per window of `window_s` at most: the first cancel after
    a quiet window is logged as it comes, those after it in its window only counted (each at
    DEBUG), and their count logged when the window ends. A client that drops thousands of streams
    at once (a timeout, a restart) costs a few lines, not one per call. Runs on the event loop."""

    def __init__(self, window_s: float = CANCEL_WINDOW_S):
        self._window_s = window_s
        self._open = False  # whether a window runs: a cancel now is counted, not logged
        self._counted = 0

    def cancelled(self, who: str, seconds: float) -> None:
        if not self._open:
            log.info("%s was cancelled by its caller after %.2f s", who, seconds)
            self._start_window()
            return
        self._counted += 1
        log.debug("%s was cancelled by its caller after %.2f s", who, seconds)

    def _start_window(self) -> None:
        self._open = True
        asyncio.get_running_loop().call_later(self._window_s, self._end_window)

    def _end_window(self) -> None:
        """Log the window's count; a storm still going (any counted) opens the next window."""
        if not self._counted:
            self._open = False
            return
        log.info(
            "%d more Generate calls were cancelled by their callers in the last %g s",
            self._counted,
            self._window_s,
        )
        self._counted = 0
        self._start_window()


@contextmanager
def request_log(worker_request_id: str, label: str, adapter: str, cancels: CancelLog) -> Iterator[None]:
    """A call that ends in an error logs at INFO, naming the status and cause, and one cancelled
    as `cancels` decides; one that finishes logs at DEBUG. The caller's strings are quoted, so
    they cannot forge lines."""
    start = time.perf_counter()
    who = f"request {worker_request_id} (request_id {quoted(label)}, adapter {quoted(adapter or '')})"
    try:
        yield
    except LoramuxError as e:
        log.info("%s ended with %s after %.2f s: %s", who, status_of(e).name, _since(start), e)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        cancels.cancelled(who, _since(start))
        raise
    log.debug("%s finished in %.2f s", who, _since(start))


def _since(start: float) -> float:
    return time.perf_counter() - start
