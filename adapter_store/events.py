"""EventHub: catalog changes fanned out to every watcher, whatever thread makes the change."""

import asyncio
import threading
from dataclasses import dataclass

from adapter_store.catalog import AdapterRecord
from shared.errors import Unavailable


@dataclass(frozen=True)
class CatalogEvent:
    kind: str  # "registered" | "deleted" | "pinned" | "unpinned"
    record: AdapterRecord


class Subscription:
    """One watcher's queue; iterate it on the event loop that subscribed."""

    def __init__(self, hub: "EventHub", loop: asyncio.AbstractEventLoop, backlog: int):
        self._hub, self._loop, self._backlog = hub, loop, backlog
        self._queue: asyncio.Queue[CatalogEvent | None] = asyncio.Queue()

    def offer(self, event: CatalogEvent) -> None:
        """Any thread. A watcher that falls `backlog` events behind is cut off (None marks it),
        so a stalled client cannot grow the store's memory; it reconnects and resyncs."""
        self._loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: CatalogEvent) -> None:
        if self._queue.qsize() >= self._backlog:
            self._hub.unsubscribe(self)
            self._queue.put_nowait(None)
        else:
            self._queue.put_nowait(event)

    def __aiter__(self):
        return self

    async def __anext__(self) -> CatalogEvent:
        event = await self._queue.get()
        if event is None:
            raise Unavailable(f"watcher fell {self._backlog} events behind; reconnect to resync")
        return event

    def close(self) -> None:
        self._hub.unsubscribe(self)


class EventHub:
    def __init__(self, backlog: int = 1024):
        self._backlog = backlog
        self._subscribers: set[Subscription] = set()
        self._lock = threading.Lock()

    def subscribe(self) -> Subscription:
        """Call on the event loop that will iterate the subscription."""
        subscription = Subscription(self, asyncio.get_running_loop(), self._backlog)
        with self._lock:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(subscription)

    def publish(self, event: CatalogEvent) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            subscription.offer(event)

    @property
    def watchers(self) -> int:
        with self._lock:
            return len(self._subscribers)
