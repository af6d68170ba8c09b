"""DeltaQueue: the deltas of one request, handed from the stepping thread to a coroutine on one
event loop.

The stepping thread never waits here, and it wakes the loop only when the consumer is already
waiting: one `call_soon_threadsafe` (a self-pipe write and a GIL handoff) per batch the consumer
takes, not one per delta. The consumer takes everything queued for it at once.
"""

import asyncio
import contextlib
import threading

from inference_service.engine.request import Delta


class DeltaQueue:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[Delta] = []
        self._waiter: asyncio.Future | None = None  # set while the consumer waits for a delta

    def put(self, delta: Delta) -> None:
        """From any thread."""
        with self._lock:
            self._pending.append(delta)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # the consumer's loop closed: nobody listens
                self._loop.call_soon_threadsafe(_wake, waiter)

    async def take(self) -> list[Delta]:
        """Every delta put since the last take, oldest first; waits for one if there is none."""
        waiter = None
        with self._lock:
            if not self._pending:
                self._waiter = waiter = self._loop.create_future()
        if waiter is not None:
            await waiter
        with self._lock:
            taken, self._pending = self._pending, []
        return taken


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():  # the consumer may have been cancelled meanwhile
        waiter.set_result(None)
