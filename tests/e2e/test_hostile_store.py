"""A worker process against a malicious adapter store (real proto, real gRPC on loopback): every
lie gets a precise FAILED_PRECONDITION or UNAVAILABLE naming the adapter and the problem, the
worker goes on serving the base model and good adapters, nothing is written outside its cache,
disk and memory stay bounded, one stalled fetch does not hold up another adapter's, and two loads
of one blob at once fetch it once."""

import hashlib
import inspect
import re
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.blob_fetch import FetchLimits
from inference_service.adapters.store_loader import StoreAdapterLoader
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared import adapter_blob
from shared.model_config import ModelConfig
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.e2e.conftest import WorkerProcess
from tests.e2e.fake_store import HostileStore, Served, start
from tests.shared.hostile_blobs import HOSTILE_BLOBS

MAX_ADAPTER_BYTES = 4 << 20
FP, UNAVAILABLE = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE
PROMPT = [5, 6, 7, 8]
# adapter id -> (status, words its message holds) for the store's lies about transport and digests
TRANSPORT_CASES = {
    "wrong-digest": (UNAVAILABLE, ("hash to", "discarded")),
    "absolute-path": (FP, ("catalog gave digest '/", "not 'sha256:' followed by 64 lowercase hex")),
    "dotdot-path": (FP, ("catalog gave digest '../../outside'", "not 'sha256:'")),
    "header-path": (FP, ("fetch header gave digest '../../header-escape'", "not 'sha256:'")),
    "truncated": (UNAVAILABLE, ("stream ended after", "resumes")),
    "huge-claim": (
        FP,
        ("50,000,000,000 bytes", f"limit of {MAX_ADAPTER_BYTES:,} bytes", "--max-adapter-bytes"),
    ),
    "overflow": (UNAVAILABLE, ("more than the 1,048,576 bytes its fetch header announced",)),
    "stall": (UNAVAILABLE, ("no data from the adapter store for 1 s", "--fetch-idle-timeout")),
    "drip": (UNAVAILABLE, ("longer than 4 s", "--fetch-timeout")),
}
CASES = {**TRANSPORT_CASES, **{name: (FP, words) for name, (_, words) in HOSTILE_BLOBS.items()}}


def _fake_digest(label: str) -> str:
    return adapter_blob.digest(label.encode())


@pytest.fixture(scope="module")
def model(tiny_models) -> ModelConfig:
    return ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture(scope="module")
def good_blobs(tiny_models, tiny_adapters, model) -> dict[str, bytes]:
    from shared.peft_checkpoint import load_peft_adapter

    peft = tiny_adapters["llama"]
    return {
        name: adapter_blob.encode(load_peft_adapter(name, peft[source], model, 16, torch.float32))
        for name, source in (("good", "qv4"), ("good2", "all8"))
    }


@pytest.fixture(scope="module")
def outside(tmp_path_factory, good_blobs) -> dict[str, Path]:
    """Files a path-like digest points at: good blobs, so reading one would serve it."""
    root = tmp_path_factory.mktemp("outside")
    files = {"absolute": root / "passwd", "dotdot": root / "worker" / "outside"}
    for path in files.values():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(good_blobs["good"])
    return files


@pytest.fixture(scope="module")
def store(good_blobs, outside):
    good = good_blobs["good"]
    qv4 = adapter_blob.decode(good)
    served = {
        "good": Served(good, adapter_blob.digest(good)),
        "good2": Served(good_blobs["good2"], adapter_blob.digest(good_blobs["good2"])),
        "wrong-digest": Served(good, _fake_digest("wrong")),
        "absolute-path": Served(good, str(outside["absolute"])),
        "dotdot-path": Served(good, "../../outside"),
        "header-path": Served(good, _fake_digest("header"), header_digest="../../header-escape"),
        "truncated": Served(good, _fake_digest("truncated"), "truncate"),
        "huge-claim": Served(b"", _fake_digest("huge"), "endless", claimed_size=50_000_000_000),
        "overflow": Served(b"", _fake_digest("overflow"), "endless", claimed_size=1 << 20),
        "stall": Served(b"", _fake_digest("stall"), "stall", claimed_size=1 << 20),
        "drip": Served(b"", _fake_digest("drip"), "drip", claimed_size=1 << 20),
    }
    for name, (make, _) in HOSTILE_BLOBS.items():
        blob = make(qv4)
        served[name] = Served(blob, adapter_blob.digest(blob))
    servicer = HostileStore(served)
    server = start(servicer)
    yield servicer
    servicer.released.set()
    server.stop(0)


def _worker(tiny_models, cache: Path, store: HostileStore, *flags: str) -> WorkerProcess:
    common = ("--max-loras", "2", "--max-cpu-loras", "2", "--kv-cache-tokens", "1024")
    return WorkerProcess(tiny_models["llama"], store.address, cache, *common, *flags).start()


@pytest.fixture(scope="module")
def worker(tiny_models, tmp_path_factory, store, outside):
    cache = outside["dotdot"].parent / "cache"  # its adapters/../../outside is outside["dotdot"]
    flags = (
        "--max-adapter-bytes",
        str(MAX_ADAPTER_BYTES),
        "--fetch-idle-timeout",
        "1",
        "--fetch-timeout",
        "4",
    )
    process = _worker(tiny_models, cache, store, *flags)
    yield process
    process.terminate()
    assert process.wait() == 0


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield inference_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="module")
def store_channel(store):
    with grpc.insecure_channel(store.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def in_process(tiny_models, tiny_adapters) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT from the in-process engine: base, good (qv4), good2 (all8)."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), max_loras=2, kv_cache_tokens=1024))
    engine.add_adapter("good", tiny_adapters["llama"]["qv4"])
    engine.add_adapter("good2", tiny_adapters["llama"]["all8"])
    names = (None, "good", "good2")
    requests = [Request(PROMPT, name, SamplingParams(max_tokens=8, temperature=0)) for name in names]
    return {name: out.token_ids for name, out in zip(names, engine.generate(requests), strict=True)}


def _generate(stub, adapter: str | None, timeout: float = 30) -> list[int]:
    request = pb.GenerateRequest(
        adapter=adapter or "",
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(max_tokens=8, temperature=0),
    )
    return [
        t for r in stub.Generate(request, timeout=timeout) if r.HasField("delta") for t in r.delta.token_ids
    ]


@pytest.mark.parametrize("case", CASES)
def test_each_lie_gets_a_precise_status(stub, case):
    status, words = CASES[case]
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, case)
    message = refused.value.details()
    assert refused.value.code() == status, message
    assert f"adapter {case!r}" in message
    for word in words:
        assert word in message, message


def test_the_worker_still_serves_base_and_good_adapters(stub, in_process):
    for name in (None, "good"):
        assert _generate(stub, name) == in_process[name], name


def test_nothing_is_written_outside_the_cache_and_disk_and_memory_stay_bounded(
    worker, store, outside, good_blobs
):
    for path in outside.values():
        assert path.read_bytes() == good_blobs["good"] and not path.with_name(path.name + ".partial").exists()
    cache = worker.cache / "adapters"
    everything = [p for p in worker.cache.parent.rglob("*") if p.is_file()]
    assert not [
        p for p in everything if "escape" in p.name or (p.name.endswith(".partial") and p.parent != cache)
    ]
    names = [p.name for p in cache.iterdir()]
    assert all(re.fullmatch(r"sha256-[0-9a-f]{64}(\.partial)?", n) for n in names), names
    assert "sha256-" + _fake_digest("huge")[7:] + ".partial" not in names  # refused before a byte
    assert sum(p.stat().st_size for p in cache.iterdir()) <= MAX_ADAPTER_BYTES
    assert _rss_bytes(worker.process.pid) < 1.5e9
    assert len(store.fetches["overflow"]) >= 1 and len(store.fetches["huge-claim"]) >= 1


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024


def test_a_good_adapter_loads_while_another_fetch_stalls(tiny_models, tmp_path, store, in_process):
    """With a 60 s idle timeout, the stalled fetch would hold a single fetch lock for the whole test."""
    flags = ("--fetch-idle-timeout", "60", "--fetch-timeout", "120")
    process = _worker(tiny_models, tmp_path / "cache", store, *flags)
    store.released.clear()
    store.fetch_started["stall"].clear()
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = inference_grpc.InferenceServiceStub(channel)
            stalled = threading.Thread(target=_expect_unavailable, args=(stub, "stall"))
            stalled.start()
            assert store.fetch_started["stall"].wait(10)
            start = time.monotonic()
            assert _generate(stub, "good2", timeout=10) == in_process["good2"]
            assert time.monotonic() - start < 10
            store.released.set()
            stalled.join(timeout=10)
            assert not stalled.is_alive()
    finally:
        store.released.set()
        process.terminate()
        assert process.wait() == 0


def _expect_unavailable(stub, adapter: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, adapter, timeout=60)
    assert refused.value.code() == UNAVAILABLE and "stall was released" in refused.value.details()


def test_a_corrupt_cached_blob_is_deleted_and_fetched_again(
    store, store_channel, good_blobs, model, tmp_path
):
    digest = adapter_blob.digest(good_blobs["good"])
    cached = tmp_path / adapter_blob.file_name(digest)
    cached.write_bytes(b"not the blob")  # a restart found this under the good blob's name
    before = len(store.fetches["good"])
    ready = _loader(store_channel, model, tmp_path, {"good": digest}).load("good")
    assert ready.digest == digest and cached.read_bytes() == good_blobs["good"]
    assert len(store.fetches["good"]) == before + 1


def test_a_partial_blob_is_resumed_where_it_ends(store, store_channel, good_blobs, model, tmp_path):
    blob = good_blobs["good2"]
    digest = adapter_blob.digest(blob)
    (tmp_path / (adapter_blob.file_name(digest) + ".partial")).write_bytes(blob[:1000])
    _loader(store_channel, model, tmp_path, {"good2": digest}).load("good2")
    assert store.fetches["good2"][-1] == 1000
    assert hashlib.sha256((tmp_path / adapter_blob.file_name(digest)).read_bytes()).hexdigest() == digest[7:]


def test_a_partial_longer_than_the_blob_is_dropped_and_fetched_whole(
    store, store_channel, good_blobs, model, tmp_path
):
    blob = good_blobs["good2"]
    digest = adapter_blob.digest(blob)
    (tmp_path / (adapter_blob.file_name(digest) + ".partial")).write_bytes(blob + b"junk")
    _loader(store_channel, model, tmp_path, {"good2": digest}).load("good2")
    assert store.fetches["good2"][-2:] == [len(blob) + 4, 0]
    assert (tmp_path / adapter_blob.file_name(digest)).read_bytes() == blob


@pytest.fixture
def paused_store(good_blobs):
    """Blob 'good' under two names (one content registered twice); every fetch of it sends half
    the blob, then waits for `resumed`."""
    blob = good_blobs["good"]
    served = Served(blob, adapter_blob.digest(blob), "pause")
    servicer = HostileStore({"good": served, "same-content": served})
    server = start(servicer)
    yield servicer
    servicer.resumed.set()
    server.stop(0)


def test_two_loads_of_one_blob_at_once_fetch_it_once(paused_store, good_blobs, model, tmp_path):
    """The second load starts while the first one's fetch is held in flight, half written: it waits
    for that fetch and reads the file it leaves, so the store sees one fetch and the partial file
    never has two writers."""
    blob = good_blobs["good"]
    digest = adapter_blob.digest(blob)
    with grpc.insecure_channel(paused_store.address) as channel:
        # idle timeout past the wait below: the held fetch must outlast it on a loaded machine
        loader = StoreAdapterLoader(
            channel, tmp_path, model, 16, torch.float32, FetchLimits(idle_timeout_s=30)
        )
        loader.sync({"good": digest, "same-content": digest})
        first = _Load(loader, "good")
        assert paused_store.fetch_started["good"].wait(10)
        second = _Load(loader, "same-content")
        deadline = time.monotonic() + 10
        while len(paused_store.fetches["good"]) < 2 and not _blocked_in_loader(second):
            assert time.monotonic() < deadline, "the second load neither fetched nor waited"
        paused_store.resumed.set()
        loads = [first.result(), second.result()]
    assert paused_store.fetches == {"good": [0]}  # fetches by digest count under the first name
    expected = AdapterImage.of(adapter_blob.decode(blob), model, torch.float32)
    for ready, name in zip(loads, ("good", "same-content"), strict=True):
        assert (ready.name, ready.digest, ready.image.ranks) == (name, digest, expected.ranks)
        assert all(map(torch.equal, ready.image.pages, expected.pages))
    assert sorted(p.name for p in tmp_path.iterdir()) == [adapter_blob.file_name(digest)]
    assert (tmp_path / adapter_blob.file_name(digest)).read_bytes() == blob


class _Load(threading.Thread):
    """loader.load(name) on a thread of its own, started at once."""

    def __init__(self, loader: StoreAdapterLoader, name: str):
        super().__init__(daemon=True)
        self._loader, self._name = loader, name
        self._outcome: object = None
        self.start()

    def run(self) -> None:
        try:
            self._outcome = self._loader.load(self._name)
        except Exception as e:  # raised again by result(), on the test's thread
            self._outcome = e

    def result(self):
        self.join(timeout=10)
        assert not self.is_alive(), f"the load of {self._name!r} did not end"
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome


def _blocked_in_loader(thread: threading.Thread) -> bool:
    """Whether `thread` waits inside the store loader's own code (not in a fetch, which the store
    would see): its innermost frame is there, at the same instruction in two looks 20 ms apart."""

    def where():
        frame = sys._current_frames().get(thread.ident)
        if frame is None or frame.f_code.co_filename != inspect.getfile(StoreAdapterLoader):
            return None
        return frame.f_code, frame.f_lasti

    first = where()
    time.sleep(0.02)
    return first is not None and where() == first


def _loader(
    channel: grpc.Channel, model: ModelConfig, cache: Path, digests: dict[str, str]
) -> StoreAdapterLoader:
    loader = StoreAdapterLoader(
        channel, cache, model, 16, torch.float32, FetchLimits(MAX_ADAPTER_BYTES, 2, 10)
    )
    loader.sync(digests)
    return loader
