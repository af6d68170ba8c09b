"""Inbox: what other threads ask of the stepping thread. Submits and aborts wait for the start of
the next step; an adapter change applies at once when no step runs and never waits for one
(the store watch makes them), else it waits the same way."""

import threading
from collections import deque
from collections.abc import Callable


class Inbox:
    def __init__(self, wakeup: threading.Event):
        self.lock = threading.RLock()  # held by a step, and by a change made between steps
        self._actions: deque[Callable[[], None]] = deque()
        self._wakeup = wakeup  # the stepping thread sleeps on it when it has nothing to do

    def post(self, action: Callable[[], None]) -> None:
        """Run `action` at the start of the next step."""
        self._actions.append(action)
        self._wakeup.set()

    def change(self, action: Callable[[], None], then: Callable[[], None]) -> None:
        """Run `action`, then `then`, now if no step runs (what was posted before comes first),
        else post `action` for the next step."""
        if not self.lock.acquire(blocking=False):
            self.post(action)
            return
        try:
            self.apply()
            action()
            then()
        finally:
            self.lock.release()

    def apply(self) -> None:
        """Run what was posted, in order; call with the lock held."""
        while self._actions:
            self._actions.popleft()()

    def __bool__(self) -> bool:
        return bool(self._actions)
