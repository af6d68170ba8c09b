"""Real processes for the SDK and CLI tests: an adapter store validating against a base model that is
only a config.json (all the store reads), the end-to-end tiny-model worker fetching from it, and the
default model (tokenizer, chat template) on a worker of its own, with a store of its own."""

import json
from pathlib import Path

import pytest

import loramux
from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig
from tests.adapter_store.conftest import ADMIN_TOKEN, StoreProcess, s3_endpoint, store_flags
from tests.conftest import TINY_MODEL
from tests.e2e.conftest import WorkerProcess, long_model, worker

__all__ = ["long_model", "s3_endpoint", "worker"]  # the fixtures, declared again for this folder

API_TOKEN = "worker-token"  # what the default-model worker wants on Generate
# A random rank-4 adapter of the default model, too small to change its greedy answers.
DEFAULT_ADAPTER = "nudge"


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
    """The store `worker` (the tiny llama, from tests/e2e) fetches from; same layer shapes."""
    flags = store_flags(sources_root, s3_endpoint, {"llama": base_model})
    process = StoreProcess(tmp_path_factory.mktemp("store"), flags).start()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="session")
def default_worker(tmp_path_factory, default_model_dir, s3_endpoint):
    """The default model on a worker that wants API_TOKEN, fetching DEFAULT_ADAPTER from its own
    store. Session-wide: the generate and CLI tests share one (it takes seconds to load)."""
    root = tmp_path_factory.mktemp("default-sources")
    model = ModelConfig.from_dir(default_model_dir)
    write_random_adapter(model, root / DEFAULT_ADAPTER, rank=4, seed=3, targets=("q_proj", "v_proj"))
    flags = store_flags(root, s3_endpoint, {"llama": default_model_dir})
    default_store = StoreProcess(tmp_path_factory.mktemp("default-store"), flags).start()
    try:
        with loramux.Client(store=default_store.address, admin_token=ADMIN_TOKEN, timeout=30) as admin:
            admin.register_adapter(DEFAULT_ADAPTER, f"file://{root / DEFAULT_ADAPTER}")
        cache = tmp_path_factory.mktemp("default-worker") / "cache"
        process = WorkerProcess(default_model_dir, default_store.address, cache, "--api-token", API_TOKEN)
        yield process.start()
        process.terminate()
        assert process.wait() == 0
    finally:
        assert default_store.stop() == 0
