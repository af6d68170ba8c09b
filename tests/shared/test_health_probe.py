"""The container healthcheck probe, run as the healthcheck runs it: a subprocess and its exit code."""

import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def health_server():
    """A gRPC server holding only the standard health service, on a free loopback port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.health_probe", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_exits_0(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = probe(target)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SERVING" in result.stdout


def test_named_service_not_serving_exits_1(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = probe(target, "readiness")
    assert result.returncode == 1
    assert "NOT_SERVING" in result.stdout


def test_unknown_service_exits_1(health_server):
    target, _ = health_server
    result = probe(target, "no-such-service")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stdout


def test_nothing_listening_exits_1_fast():
    start = time.monotonic()
    result = probe(f"127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stdout
    assert time.monotonic() - start < 5
