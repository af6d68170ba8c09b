"""A real adapter store and inference worker, each its own process on a loopback port, for the
benchmarks that measure what a client of the service sees."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import loramux
from shared import tcmalloc


def start(module: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m module --listen 127.0.0.1:0 ...`, on tcmalloc where it is installed (as `make run`
    starts its services); returns the process and the address it printed on its first line."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=tcmalloc.preloading({**os.environ, **(env or {})}),
    )
    first = process.stdout.readline().split()
    if not first:
        raise RuntimeError(f"{module} exited with {process.wait()} before listening")
    return process, first[-1]


def wait_ready(address: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="readiness")
        while health.Check(request).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker at {address} not ready after {timeout_s} s")
            time.sleep(0.2)


@contextmanager
def service(module: str, *args: str, env: dict | None = None) -> Iterator[str]:
    """`python -m module` on a loopback port (start); yields its address, stops it on exit."""
    process, address = start(module, *args, env=env)
    try:
        yield address
    finally:
        process.terminate()
        process.wait()


@contextmanager
def services(
    model_dir: Path, allowed_root: Path, work_dir: Path, *worker_flags: str
) -> Iterator[tuple[str, str]]:
    """A store serving file:// adapters under `allowed_root` and a ready worker following it, each
    its own process; yields their addresses (worker, store). Both stop on exit."""
    with service(
        "adapter_store", "--data-dir", str(work_dir / "store"), "--allowed-root", str(allowed_root)
    ) as store:
        worker_args = ("--store", store, "--model", str(model_dir), *worker_flags)
        with service(
            "inference_service", *worker_args, env={"LORAMUX_CACHE": str(work_dir / "worker")}
        ) as worker:
            wait_ready(worker)
            yield worker, store


@contextmanager
def local_stack(
    model_dir: Path, allowed_root: Path, work_dir: Path, *worker_flags: str
) -> Iterator[loramux.Client]:
    """services(), and an SDK client for both, its worker channel already open."""
    with (
        services(model_dir, allowed_root, work_dir, *worker_flags) as (address, store_address),
        loramux.Client(worker=address, store=store_address) as client,
    ):
        client.model_info()  # opens the worker's channel before many threads share it
        yield client
