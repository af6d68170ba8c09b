"""A real adapter store process for the SDK and CLI tests, validating against a base model that is
only a config.json (all the store reads), and an in-process fake worker."""

import json
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.adapter_store.conftest import StoreProcess, s3_endpoint, store_flags
from tests.client.fake_worker import FakeWorker
from tests.conftest import TINY_MODEL

__all__ = ["s3_endpoint"]  # the fixture, declared again for this folder


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base-model")
    (folder / "config.json").write_text(json.dumps({**TINY_MODEL, "model_type": "llama"}))
    return folder


@pytest.fixture(scope="session")
def sources_root(tmp_path_factory, base_model) -> Path:
    """The allowed root of file:// sources: adapters qv4 (rank 4 on q, v) and all8 (rank 8)."""
    root = tmp_path_factory.mktemp("sources")
    model = ModelConfig.from_dir(base_model)
    write_random_adapter(model, root / "qv4", rank=4, seed=1, targets=("q_proj", "v_proj"))
    write_random_adapter(model, root / "all8", rank=8, seed=2)
    return root


@pytest.fixture(scope="session")
def store(tmp_path_factory, sources_root, s3_endpoint, base_model):
    flags = store_flags(sources_root, s3_endpoint, {"llama": base_model})
    process = StoreProcess(tmp_path_factory.mktemp("store"), flags).start()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="session")
def worker():
    """The fake worker on a free loopback port: (address, servicer)."""
    fake = FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    inference_grpc.add_InferenceServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", fake
    server.stop(grace=None)
