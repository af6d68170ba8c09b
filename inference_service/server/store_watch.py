"""StoreWatch: follows the store's WatchAdapters stream in a thread, so the worker drops deleted
adapters, never serves a stale digest, and preloads pinned ones. When the store is down it keeps
reconnecting; the worker keeps serving what it holds meanwhile."""

import logging
import threading

import grpc

from inference_service.adapters.store_loader import StoreAdapterLoader
from inference_service.engine import Engine
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
Event = pb.AdapterEvent
RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class StoreWatch:
    def __init__(self, channel: grpc.Channel, engine: Engine, loader: StoreAdapterLoader):
        self._stub = pb_grpc.AdapterStoreStub(channel)
        self._engine, self._loader = engine, loader
        self._stop = threading.Event()
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)
        self.synced = threading.Event()  # set while the view mirrors a live stream

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._follow()
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                log.warning("adapter store watch lost (%s); retrying", e.code().name)
            except Exception:  # a bug applying one event must not end following the store
                log.exception("applying an adapter store event failed; resyncing")
            self.synced.clear()
            self._loader.sync(None)
            failures += 1
            self._stop.wait(RETRY_S[min(failures, len(RETRY_S)) - 1])

    def _follow(self) -> None:
        self._stream = self._stub.WatchAdapters(pb.WatchAdaptersRequest())
        snapshot: dict[str, pb.Adapter] = {}
        try:
            for event in self._stream:
                if event.type == Event.TYPE_EXISTING:
                    snapshot[event.adapter.adapter_id] = event.adapter
                elif event.type == Event.TYPE_SYNCED:
                    self._resync(snapshot)
                else:
                    self._apply(event)
        finally:
            self._stream.cancel()

    def _resync(self, snapshot: dict[str, pb.Adapter]) -> None:
        """Whatever changed while the stream was down: deleted or re-registered adapters are
        dropped (requests submitted before keep the content they have), pinned ones preloaded."""
        self._loader.sync({name: a.digest for name, a in snapshot.items()})
        for name, held in self._engine.held_digests().items():
            if name not in snapshot:
                self._engine.remove_adapter(name, missing_ok=True)
            elif snapshot[name].digest != held:
                self._engine.adapter_changed(name)
        for adapter in snapshot.values():
            self._set_pinned(adapter)
        self.synced.set()
        log.info("following the adapter store: %d adapters", len(snapshot))

    def _apply(self, event: pb.AdapterEvent) -> None:
        adapter = event.adapter
        if event.type == Event.TYPE_DELETED:
            self._engine.remove_adapter(adapter.adapter_id, missing_ok=True)
            return
        self._loader.learn(adapter.adapter_id, adapter.digest)
        if event.type == Event.TYPE_REGISTERED:
            self._engine.adapter_changed(adapter.adapter_id)  # any older content, once unused
        self._set_pinned(adapter)

    def _set_pinned(self, adapter: pb.Adapter) -> None:
        if adapter.pinned:
            self._engine.pin_adapter(adapter.adapter_id)  # starts its load if it is not held
        else:
            self._engine.unpin_adapter(adapter.adapter_id)  # nothing to do where it is not pinned
