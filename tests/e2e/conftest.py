"""Real processes on loopback: an adapter store (with moto's S3 server beside it) and inference
workers fetching from it, driven through gRPC clients."""

import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from tests.adapter_store.conftest import (  # noqa: F401 - s3_endpoint, sources_root: fixtures
    AUTH,
    StoreProcess,
    s3_endpoint,
    sources_root,
    spawn,
    store_flags,
)
from tests.conftest import build_tiny_model


def until(condition, timeout_s: float = 15.0) -> None:
    """Poll `condition` every 0.1 s until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`python -m inference_service` on a free loopback port, fetching from `store` (None: no store,
    base model only)."""

    def __init__(self, model: Path, store: str | None, cache: Path, *flags: str):
        link = ["--store", store] if store else []
        self.args = ["--listen", "127.0.0.1:0", *link, "--model", str(model), *flags]
        self.cache = cache
        self.log = cache.with_suffix(".log")
        self.process: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> "WorkerProcess":
        env = {"LORAMUX_CACHE": str(self.cache)}
        self.process, self.address = spawn("inference_service", self.args, env, self.log)
        wait_ready(self.address, self.log)
        return self

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 30) -> int:
        return self.process.wait(timeout=timeout_s)


def wait_ready(address: str, log: Path, timeout_s: float = 60) -> None:
    """Returns once the worker at `address` reports readiness (its model loaded): it listens
    before, and answers Generate with UNAVAILABLE until then."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(service="readiness")).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
    raise RuntimeError(f"worker not ready:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def store_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def store(tmp_path_factory, sources_root, s3_endpoint, tiny_models):  # noqa: F811
    """A store on a fixed port, so one restarted after a kill is found where workers look."""
    flags = store_flags(sources_root, s3_endpoint, tiny_models)
    process = StoreProcess(tmp_path_factory.mktemp("e2e-store"), flags, f"127.0.0.1:{free_port()}").start()
    yield process
    if process.process.poll() is None:
        process.stop()


@pytest.fixture(scope="module")
def admin(store):
    with grpc.insecure_channel(store.address) as channel:
        yield store_grpc.AdapterStoreStub(channel)


def register(admin, adapter_id: str, uri: str) -> store_pb.Adapter:
    request = store_pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=uri)
    return admin.RegisterAdapter(request, metadata=AUTH)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny llama with room for streams long enough to act on while they run; its layer
    shapes equal the tiny llama's, so the same adapters fit."""
    return build_tiny_model(tmp_path_factory.mktemp("long") / "llama", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def worker(tmp_path_factory, long_model, store):
    process = WorkerProcess(
        long_model,
        store.address,
        tmp_path_factory.mktemp("worker") / "cache",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--kv-cache-tokens",
        "8192",
    ).start()
    yield process
    if process.process.poll() is None:
        process.terminate()
        assert process.wait() == 0


@pytest.fixture
def generate(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield inference_grpc.InferenceServiceStub(channel)
