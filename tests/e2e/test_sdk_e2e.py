"""The store and a worker as real processes, driven only through loramux.Client: adapters registered,
served side by side, reported by the worker, and deleted."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import loramux
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from tests.adapter_store.conftest import ADMIN_TOKEN

ADAPTERS = ("all8", "qv4", "mlp16rs", "re2")  # four adapters on a worker with two device slots
# (adapter or None, prompt token ids, max_tokens)
WORKLOAD = [
    ("all8", [9, 10, 11], 10),
    (None, [5, 6, 7, 8], 12),
    ("qv4", [12, 13, 14, 15, 16], 9),
    ("mlp16rs", [17, 18], 11),
    ("re2", [19, 20, 21, 22], 8),
    ("qv4", [29], 13),
    ("all8", [23, 24, 25, 26, 27, 28], 7),
]


@pytest.fixture
def client(worker, store):
    with loramux.Client(worker=worker.address, store=store.address, admin_token=ADMIN_TOKEN, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def registered(store, sources_root) -> dict[str, str]:
    """Every ADAPTERS entry registered through the SDK: adapter id -> digest."""
    with loramux.Client(store=store.address, admin_token=ADMIN_TOKEN, timeout=60) as admin:
        adapters = [admin.register_adapter(name, f"file://{sources_root / name}") for name in ADAPTERS]
    return {a.adapter_id: a.digest for a in adapters}


@pytest.fixture(scope="module")
def in_process(long_model, tiny_adapters) -> list[list[int]]:
    """Every WORKLOAD request's greedy tokens from the in-process engine."""
    engine = Engine(
        EngineConfig(model=str(long_model), max_loras=4, kv_cache_tokens=2048, max_model_len=2048)
    )
    for name in ADAPTERS:
        engine.add_adapter(name, tiny_adapters["llama"][name])
    requests = [
        Request(ids, adapter, SamplingParams(max_tokens=n, temperature=0)) for adapter, ids, n in WORKLOAD
    ]
    return [out.token_ids for out in engine.generate(requests)]


def test_mixed_adapters_through_the_sdk_equal_the_in_process_engine(client, registered, in_process):
    def complete(work) -> loramux.Completion:
        adapter, ids, max_tokens = work
        return client.complete(token_ids=ids, adapter=adapter, max_tokens=max_tokens, temperature=0)

    with ThreadPoolExecutor(len(WORKLOAD)) as pool:
        results = list(pool.map(complete, WORKLOAD))
    for i, result in enumerate(results):
        assert result.token_ids == in_process[i], f"request {i} ({WORKLOAD[i][0]})"
        assert (result.prompt_tokens, result.completion_tokens) == (len(WORKLOAD[i][1]), len(in_process[i]))

    held = client.worker_adapters()
    assert held and all(registered[a.adapter_id] == a.digest for a in held)
    assert all(a.location in ("device", "host") and not a.pinned for a in held)


def test_a_deleted_adapter_is_not_found_on_the_worker(client, registered):
    assert client.complete(token_ids=[5, 6], adapter="re2", max_tokens=2).completion_tokens == 2
    assert client.delete_adapter("re2").digest == registered["re2"]

    deadline = time.monotonic() + 15
    with pytest.raises(loramux.NotFound) as e:
        while time.monotonic() < deadline:  # the worker hears of the delete on its watch stream
            client.complete(token_ids=[5, 6], adapter="re2", max_tokens=2)
            time.sleep(0.1)
    assert "re2" in e.value.message
    assert "re2" not in {a.adapter_id for a in client.worker_adapters()}
