"""Adapter-affinity routing through real nginx: deploy/nginx/loramux.conf as shipped, in a temp
prefix on loopback, in front of three real workers fetching twenty adapters from two real stores
that share one catalog in S3 (moto's server), half the adapters registered through each: issue
14's whole topology. Where requests landed is read from the workers' Prometheus /metrics, never
from nginx. The tests run in file order on the same processes: the last ones kill workers."""

import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

import loramux
from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig
from tests.adapter_store.conftest import ADMIN_TOKEN, BUCKET, REPO, StoreProcess
from tests.e2e.conftest import WorkerProcess, free_port
from tests.prometheus_scrape import find, logged_metrics_address, scrape, value

DEPLOY = REPO / "deploy" / "nginx"
ADAPTERS = [f"tenant-{i:02d}" for i in range(20)]
REQUESTS = 300
SHORT = dict(token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
LONG = dict(token_ids=[5, 6], max_tokens=4000, ignore_eos=True)  # seconds of steps on the tiny llama


class Nginx:
    """`nginx -p PREFIX -c PREFIX/loramux.conf`: the shipped file copied unchanged, beside a
    listen.conf on a free loopback port and an upstreams.conf naming `workers` with the shipped
    server parameters (max_fails, fail_timeout)."""

    def __init__(self, prefix: Path, workers: list[str]):
        self.prefix = prefix
        self.address = f"127.0.0.1:{free_port()}"
        self.workers = workers
        self.process: subprocess.Popen | None = None

    def start(self) -> "Nginx":
        binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
        assert binary, "nginx is not installed: `make test` installs Debian's nginx with apt-get"
        shutil.copy(DEPLOY / "loramux.conf", self.prefix / "loramux.conf")
        (self.prefix / "listen.conf").write_text(f"listen {self.address} http2;\n")
        (self.prefix / "upstreams.conf").write_text(self._upstreams())
        command = [binary, "-e", "stderr", "-p", f"{self.prefix}/", "-c", str(self.prefix / "loramux.conf")]
        with open(self.prefix / "error.log", "w") as errors:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
        self._wait_listening()
        return self

    def _upstreams(self) -> str:
        """One server line per worker, with the parameters of the shipped file's first one."""
        shipped = next(
            line
            for line in (DEPLOY / "upstreams.conf").read_text().splitlines()
            if line.startswith("server ")
        )
        params = " ".join(shipped.rstrip(";").split()[2:])
        return "".join(f"server {address} {params};\n" for address in self.workers)

    def _wait_listening(self, timeout_s: float = 10) -> None:
        host, port = self.address.split(":")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not start:\n{(self.prefix / 'error.log').read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGQUIT)  # graceful: finish the calls in flight, then exit
        self.process.wait(timeout=15)


@pytest.fixture(scope="module")
def affinity_stores(tmp_path_factory, long_model, s3_endpoint):
    """Two stores validating against the long tiny llama on one shared catalog, ADAPTERS (random
    rank 4) registered through them in turn."""
    sources = tmp_path_factory.mktemp("affinity-sources")
    model = ModelConfig.from_dir(long_model)
    catalog = f"s3://{BUCKET}/affinity/{uuid.uuid4().hex}"
    flags = ["--allowed-root", str(sources), "--admin-token", ADMIN_TOKEN, "--base-model", str(long_model)]
    flags += ["--s3-endpoint", s3_endpoint, "--catalog", catalog, "--catalog-poll-s", "0.2"]
    stores = [StoreProcess(tmp_path_factory.mktemp(f"affinity-store-{n}"), flags) for n in "ab"]
    with ThreadPoolExecutor(2) as pool:  # most of a start is importing torch: side by side
        list(pool.map(StoreProcess.start, stores))
    for seed, name in enumerate(ADAPTERS):
        folder = write_random_adapter(model, sources / name, rank=4, seed=seed, targets=("q_proj", "v_proj"))
        store = stores[seed % 2]
        with loramux.Client(store=store.address, admin_token=ADMIN_TOKEN, timeout=30) as admin:
            admin.register_adapter(name, f"file://{folder}")
    yield stores
    assert [store.stop() for store in stores] == [0, 0]


@dataclass
class Worker:
    """A worker process and the HOST:PORT of its /metrics."""

    process: WorkerProcess
    metrics: str

    def kill(self) -> None:
        self.process.process.kill()
        self.process.wait()

    def served(self) -> Counter:
        """Requests this worker finished, by adapter (the base model left out)."""
        counts = Counter()
        for sample in find(scrape(self.metrics), "loramux:requests_finished_total"):
            if sample.labels["adapter"]:
                counts[sample.labels["adapter"]] += int(sample.value)
        return counts


@pytest.fixture(scope="module")
def workers(tmp_path_factory, long_model, affinity_stores) -> list[Worker]:
    """Three workers started side by side, attached to the stores in turn (a store sidecar serves
    its pod's worker). Every adapter fits in each one's host tier, so an adapter loads at most
    once per worker."""
    flags = ["--max-loras", "4", "--max-cpu-loras", str(len(ADAPTERS)), "--kv-cache-tokens", "40000"]
    processes = [
        WorkerProcess(
            long_model,
            affinity_stores[i % 2].address,
            tmp_path_factory.mktemp(f"w{i}") / "cache",
            *flags,
            *("--metrics-listen", "127.0.0.1:0"),
        )
        for i in range(3)
    ]
    with ThreadPoolExecutor(len(processes)) as pool:
        started = [Worker(p, logged_metrics_address(p.log)) for p in pool.map(WorkerProcess.start, processes)]
    yield started
    for worker in started:
        if worker.process.process.poll() is None:
            worker.kill()


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, workers):
    router = Nginx(tmp_path_factory.mktemp("nginx"), [w.process.address for w in workers]).start()
    yield router
    router.stop()


def owners(workers: list[Worker]) -> dict[str, list[int]]:
    """adapter -> the indexes (in `workers`) of the workers that have served it."""
    found: dict[str, list[int]] = {}
    for i, worker in enumerate(workers):
        for adapter in worker.served():
            found.setdefault(adapter, []).append(i)
    return found


def test_each_adapter_is_loaded_once_and_served_where_it_is_held(nginx, workers):
    work = [ADAPTERS[i % len(ADAPTERS)] for i in range(REQUESTS)]
    random.Random(0).shuffle(work)
    with loramux.Client(worker=nginx.address, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: client.complete(adapter=a, **SHORT), work))
    assert all(r.completion_tokens == 2 for r in results)

    samples = [scrape(w.metrics) for w in workers]
    assert sum(sum(w.served().values()) for w in workers) == REQUESTS
    assert all(value(s, "loramux:host_tier_evictions_total") == 0 for s in samples)  # a miss is a load
    loads = sum(value(s, "loramux:host_tier_misses_total") for s in samples)
    # Of the requests after each adapter's first load, those that hit a worker already holding it.
    on_holder = (REQUESTS - loads) / (REQUESTS - len(ADAPTERS))
    assert on_holder >= 0.95, [dict(w.served()) for w in workers]
    assert sum(1 for w in workers if w.served()) >= 2  # the hash spreads adapters over the workers


def test_an_oversized_request_is_refused_by_the_worker_not_by_nginx(nginx):
    """nginx's body limit lies above the worker's 4 MiB message limit, so the caller hears the
    worker's RESOURCE_EXHAUSTED rather than an anonymous HTTP 413 (gRPC status UNKNOWN)."""
    with loramux.Client(worker=nginx.address, timeout=30) as client, pytest.raises(loramux.ResourceExhausted):
        client.complete("x" * (5 << 20), adapter=ADAPTERS[0], max_tokens=1)


def test_a_killed_worker_fails_its_streams_and_its_adapters_move_on(nginx, workers):
    with loramux.Client(worker=nginx.address, timeout=30) as client:
        for adapter in ADAPTERS:  # every adapter on its worker (already so after the test above)
            client.complete(adapter=adapter, **SHORT)
        where = owners(workers)
        victim = Counter(i for held in where.values() for i in held).most_common(1)[0][0]
        lost = [a for a, held in where.items() if held == [victim]]
        kept = [a for a, held in where.items() if victim not in held]
        assert lost and kept
        doomed = [Streaming(client, a) for a in lost[:3]]
        surviving = [Streaming(client, a) for a in kept[:2]]
        for stream in doomed + surviving:
            stream.wait_first_delta()

        workers[victim].kill()  # SIGKILL: no drain, no goodbye
        for stream in doomed:
            assert stream.error(within_s=10).code == grpc.StatusCode.UNAVAILABLE
        for stream in surviving:
            stream.still_streaming()
        for adapter in lost + lost:  # twice: the second call finds the adapter where the first went
            assert client.complete(adapter=adapter, **SHORT).completion_tokens == 2
    moved = owners([w for i, w in enumerate(workers) if i != victim])
    assert all(len(moved.get(a, [])) == 1 for a in lost), moved  # each to one next worker, and it stays


def test_with_every_worker_gone_calls_fail_at_once_with_unavailable(nginx, workers):
    for worker in workers:
        if worker.process.process.poll() is None:
            worker.kill()
    with loramux.Client(worker=nginx.address, timeout=10) as client:
        for adapter in (ADAPTERS[0], None):
            start = time.monotonic()
            with pytest.raises(loramux.Unavailable, match="no loramux worker took the call"):
                client.complete(token_ids=[5], adapter=adapter, max_tokens=1)
            assert time.monotonic() - start < 5


class Streaming:
    """A LONG Generate through nginx, read on a thread of its own."""

    def __init__(self, client: loramux.Client, adapter: str):
        self.stream = client.generate(adapter=adapter, **LONG)
        self.deltas = 0
        self.failure: loramux.LoramuxError | None = None
        self.first = threading.Event()
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for _ in self.stream:
                self.deltas += 1
                self.first.set()
        except loramux.LoramuxError as e:
            self.failure = e
        finally:
            self.ended.set()

    def wait_first_delta(self) -> None:
        assert self.first.wait(20), "no token within 20 s"

    def error(self, within_s: float) -> loramux.LoramuxError:
        assert self.ended.wait(within_s), f"stream still open {within_s} s after its worker died"
        assert self.failure is not None
        return self.failure

    def still_streaming(self) -> None:
        seen = self.deltas
        deadline = time.monotonic() + 10
        while self.deltas <= seen + 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.deltas > seen + 5 and self.failure is None
        self.stream.close()
