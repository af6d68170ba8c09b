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
        self._open = True
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def enter(self):
        if not self._open:
            raise Unavailable("the worker is shutting down; retry on another worker")
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

    def close(self) -> None:
        self._open = False

    async def drained(self, timeout_s: float) -> bool:
        """Whether every admitted call finished within the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
