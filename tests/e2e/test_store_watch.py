"""StoreWatch against a real store process: a failure applying one event does not end following
the store; the watch reconnects, resyncs and applies what it missed."""

import threading
import time

import grpc
import torch

from inference_service.adapters.store_loader import StoreAdapterLoader
from inference_service.server.store_watch import StoreWatch
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from tests.adapter_store.conftest import AUTH
from tests.e2e.conftest import register


class FlakyEngine:
    """The engine calls StoreWatch makes, recorded; the first pin raises as a bug would."""

    def __init__(self):
        self.pins: list[str] = []
        self.pinned_again = threading.Event()

    def pin_adapter(self, name: str) -> None:
        self.pins.append(name)
        if len(self.pins) == 1:
            raise RuntimeError("bug while pinning")
        self.pinned_again.set()

    def held_digests(self) -> dict[str, str]:
        return {}

    def remove_adapter(self, name: str, missing_ok: bool = False) -> None:
        pass

    def adapter_changed(self, name: str) -> None:
        pass

    def unpin_adapter(self, name: str) -> None:
        pass


def test_a_failing_event_does_not_stop_the_watch(store, admin, sources_root, tiny_models, tmp_path):
    engine = FlakyEngine()
    with grpc.insecure_channel(store.address) as channel:
        model = ModelConfig.from_dir(tiny_models["llama"])
        loader = StoreAdapterLoader(channel, tmp_path / "cache", model, 16, torch.float32)
        watch = StoreWatch(channel, engine, loader)
        watch.start()
        try:
            _until(watch.synced.is_set)
            register(admin, "watched", f"file://{sources_root / 'qv4'}")
            admin.PinAdapter(store_pb.PinAdapterRequest(adapter_id="watched"), metadata=AUTH)
            assert engine.pinned_again.wait(timeout=15), f"pins seen: {engine.pins}"
            assert engine.pins[:2] == ["watched", "watched"]  # the pin event, then the resync
            _until(watch.synced.is_set)
            assert "watched" in loader
        finally:
            watch.stop()


def _until(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
