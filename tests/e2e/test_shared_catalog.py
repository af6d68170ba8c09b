"""Two store sidecars on one shared S3 catalog (moto's server), a worker attached to each: an
adapter registered through either store is served by both workers, token for token as the
in-process engine serves it, and a delete through one store reaches the other store's worker."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from tests.adapter_store.conftest import AUTH, BUCKET, StoreProcess, store_flags
from tests.e2e.conftest import WorkerProcess, register, until

PROMPT, MAX_TOKENS = [5, 6, 7, 8], 8
SOURCES = {"from-a": "qv4", "from-b": "all8"}  # adapter -> tiny adapter, registered through a, b


@pytest.fixture(scope="module")
def pods(tmp_path_factory, sources_root, s3_endpoint, tiny_models):
    """Two pods, each a store on the shared catalog and a worker fetching from it; yields
    (store stub, worker stub) per pod."""
    catalog = ["--catalog", f"s3://{BUCKET}/e2e-shared/{uuid.uuid4().hex}", "--catalog-poll-s", "0.2"]
    flags = store_flags(sources_root, s3_endpoint, tiny_models, *catalog)
    stores = [StoreProcess(tmp_path_factory.mktemp(f"shared-store-{n}"), flags) for n in "ab"]
    with ThreadPoolExecutor(2) as pool:  # most of a start is importing torch: side by side
        list(pool.map(StoreProcess.start, stores))
        workers = [_worker(tiny_models["llama"], s.address, tmp_path_factory.mktemp("pod")) for s in stores]
        list(pool.map(WorkerProcess.start, workers))
    channels = [grpc.insecure_channel(p.address) for p in (*stores, *workers)]
    yield [
        (store_grpc.AdapterStoreStub(channels[n]), inference_grpc.InferenceServiceStub(channels[2 + n]))
        for n in range(2)
    ]
    for channel in channels:
        channel.close()
    for worker in workers:
        worker.terminate()
    assert [w.wait() for w in workers] + [s.stop() for s in stores] == [0] * 4


def _worker(model, store: str, folder) -> WorkerProcess:
    return WorkerProcess(model, store, folder / "cache", "--max-loras", "2", "--kv-cache-tokens", "2048")


@pytest.fixture(scope="module")
def expected(tiny_models, tiny_adapters) -> dict[str, list[int]]:
    """Each adapter's greedy tokens for PROMPT from the in-process engine."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), max_loras=2, kv_cache_tokens=2048))
    for name, source in SOURCES.items():
        engine.add_adapter(name, tiny_adapters["llama"][source])
    outputs = engine.generate([Request(PROMPT, name, _params()) for name in SOURCES])
    return {name: out.token_ids for name, out in zip(SOURCES, outputs, strict=True)}


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def _generate(worker, adapter: str) -> list[int]:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    request = pb.GenerateRequest(adapter=adapter, token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling)
    return [t for r in worker.Generate(request, timeout=60) if r.HasField("delta") for t in r.delta.token_ids]


def test_an_adapter_registered_through_either_store_is_served_by_every_worker(pods, sources_root, expected):
    for (store, _), (name, source) in zip(pods, SOURCES.items(), strict=True):
        register(store, name, f"file://{sources_root / source}")
    for _, worker in pods:
        for name in SOURCES:
            # A worker serves the adapters its store's watch announced: the other store's, within
            # the poll lag.
            until(lambda worker=worker, name=name: _status(worker, name) == grpc.StatusCode.OK)
            assert _generate(worker, name) == expected[name], name


def test_a_delete_through_one_store_reaches_the_other_stores_worker(pods, sources_root):
    (store_a, _), (_, worker_b) = pods
    register(store_a, "short-lived", f"file://{sources_root / 're2'}")
    until(lambda: _status(worker_b, "short-lived") == grpc.StatusCode.OK)
    store_a.DeleteAdapter(store_pb.DeleteAdapterRequest(adapter_id="short-lived"), metadata=AUTH)
    until(lambda: _status(worker_b, "short-lived") == grpc.StatusCode.NOT_FOUND)


def _status(worker, adapter: str) -> grpc.StatusCode:
    try:
        _generate(worker, adapter)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK
