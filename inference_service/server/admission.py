"""Admission: the bound on requests a worker holds at once, and the gate that closes on shutdown."""

import asyncio
from contextlib import contextmanager

from shared.errors import ResourceExhausted, Unavailable


class Admission:
    """Counts Generate calls from arrival to their last message. Refusing at the door, before any
    tokenizing, keeps an overloaded worker answering quickly instead of queueing without end."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_flight = 0
        self._closed_because: str | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def enter(self):
        if self._closed_because is not None:
            raise Unavailable(self._closed_because)
        if self.in_flight >= self.capacity:
            raise ResourceExhausted(f"the worker holds {self.in_flight} requests, its limit; retry later")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def close(self, because: str = "the worker is shutting down; retry on another worker") -> None:
        """Refuse every later call with UNAVAILABLE and this message."""
        self._closed_because = because

    async def drained(self, timeout_s: float) -> bool:
        """Whether every admitted call finished within the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
