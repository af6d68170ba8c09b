"""What an operator's probes wait for while workers are saturated: GetStats, a Prometheus scrape
of /metrics and ListAdapters, each timed beside a health check, against several worker processes
of the default model sharing this machine's cores, every one decoding streams without pause.

Before the engine published a snapshot after each step these reads waited for the step's lock,
and under CPU contention kept losing it (seconds, past Prometheus' default 10 s scrape timeout);
a health check never touched the engine. The figures are each probe's latency percentiles and
its median over the health check's.

    .venv/bin/python -m bench.stats_latency [--workers 4] [--streams 8] [--seconds 60]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cache import default_model_dir
from bench.local_stack import wait_ready
from bench.provenance import provenance
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc

METRICS_ADDRESS = re.compile(r"Prometheus metrics on http://(\S+)/metrics")
PROBE_TIMEOUT_S = 30.0  # a probe still waiting then is recorded at this latency


class Worker:
    """`python -m inference_service` (base model only) with --metrics-listen on a free port."""

    def __init__(self, model_dir: Path, log: Path):
        args = ["--listen", "127.0.0.1:0", "--model", str(model_dir), "--metrics-listen", "127.0.0.1:0"]
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "inference_service", *args],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "LORAMUX_CACHE": str(log.parent)},
            )
        self.address = self.process.stdout.readline().split()[-1]
        self.log = log

    def metrics_address(self) -> str:
        while not (found := METRICS_ADDRESS.search(self.log.read_text())):
            time.sleep(0.1)
        return found.group(1)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def saturate(address: str, streams: int, stop: threading.Event) -> list[threading.Thread]:
    """`streams` greedy streams of 256 tokens each, restarted as each ends, until `stop`."""

    def loop(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = inference_grpc.InferenceServiceStub(channel)
            params = pb.SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100 + i] * 32), sampling=params)
            while not stop.is_set():
                try:
                    for _ in stub.Generate(request, timeout=600):
                        if stop.is_set():
                            break
                except grpc.RpcError:
                    if not stop.is_set():
                        raise  # the workers are killed once stop is set

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    return threads


def probes(address: str, metrics: str) -> dict[str, Callable[[], object]]:
    channel = grpc.insecure_channel(address)
    health, stub = health_pb2_grpc.HealthStub(channel), inference_grpc.InferenceServiceStub(channel)
    timeout = PROBE_TIMEOUT_S
    return {
        "health": lambda: health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=timeout),
        "GetStats": lambda: stub.GetStats(pb.GetStatsRequest(), timeout=timeout),
        "/metrics": lambda: urllib.request.urlopen(f"http://{metrics}/metrics", timeout=timeout).read(),
        "ListAdapters": lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=timeout),
    }


def timed(probe: Callable[[], object]) -> float:
    start = time.perf_counter()
    try:
        probe()
    except (grpc.RpcError, OSError):  # a deadline passed: it waited at least that long
        return max(time.perf_counter() - start, PROBE_TIMEOUT_S)
    return time.perf_counter() - start


def measure(workers: list[Worker], seconds: float) -> dict[str, list[float]]:
    """Each probe of each worker in turn, a round every 0.5 s, for `seconds`."""
    every = [probes(w.address, w.metrics_address()) for w in workers]
    latencies: dict[str, list[float]] = {name: [] for name in every[0]}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for worker_probes in every:
            for name, probe in worker_probes.items():
                latencies[name].append(timed(probe))
        time.sleep(0.5)
    return latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(latencies: dict[str, list[float]]) -> list[str]:
    health = statistics.median(latencies["health"])
    lines = [f"{'probe':<13} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'p50 / health':>13}"]
    for name, values in latencies.items():
        p50 = statistics.median(values)
        lines.append(
            f"{name:<13} {len(values):>4} {p50 * 1e3:>9.1f} {percentile(values, 99) * 1e3:>9.1f} "
            f"{max(values) * 1e3:>9.1f} {p50 / health:>13.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per worker")
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    model_dir = default_model_dir()
    origin = provenance()
    print(f"commit {origin['commit']}, {origin['machine']['cpu']}, {origin['machine']['usable_cpus']} cpus")
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"worker{i}" / "stderr.log" for i in range(args.workers)]
        for log in logs:
            log.parent.mkdir()
        workers = [Worker(model_dir, log) for log in logs]
        stop = threading.Event()
        try:
            for worker in workers:
                wait_ready(worker.address)
            for worker in workers:
                saturate(worker.address, args.streams, stop)
            time.sleep(5)  # every worker decoding
            latencies = measure(workers, args.seconds)
        finally:
            stop.set()
            for worker in workers:
                worker.stop()
    print(f"{args.workers} workers x {args.streams} streams, probed for {args.seconds:g} s:")
    print("\n".join(report(latencies)))


if __name__ == "__main__":
    main()
