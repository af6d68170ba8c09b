"""The processes `make run` starts: its OpenAI gateway listens on the port asked for (or a free one
when that is taken) at the address the demo prints, and Ctrl-C stops the gateway first, then the
worker, then the store, each cleanly. The model, worker and store are not needed for this."""

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from inference_service.demo import demo

# Stands in for a service: says when its SIGTERM handler is in place, and on SIGTERM appends its
# name to a file and exits 0.
SERVICE = """
import signal, sys, time
def stop(*_):
    with open(sys.argv[1], "a") as log:
        log.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture(autouse=True)
def signal_mask():
    """demo._stop blocks the stop signals for good (the demo exits right after); not in pytest."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(address: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start_gateway(port: int, worker: str) -> tuple[subprocess.Popen, str]:
    gateway = demo._spawn_gateway(port, worker, f"127.0.0.1:{free_port()}")
    try:
        return gateway, demo._gateway_address(gateway)
    except BaseException:
        gateway.kill()
        raise


def test_gateway_listens_on_the_port_asked_for_and_reaches_for_the_demo_worker(capfd):
    port, worker = free_port(), f"127.0.0.1:{free_port()}"
    gateway, address = start_gateway(port, worker)
    try:
        assert address == f"127.0.0.1:{port}"
        status, body = health(address)
        # 503 naming the worker's address: the gateway is up and asks the worker the demo gave it.
        assert status == 503 and worker in body["reason"], body
    finally:
        demo._stop([gateway])
    assert gateway.returncode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_gateway_takes_a_free_port_when_the_one_asked_for_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        gateway, address = start_gateway(port, f"127.0.0.1:{free_port()}")
        try:
            assert address.startswith("127.0.0.1:") and address != f"127.0.0.1:{port}"
            assert health(address)[0] == 503
        finally:
            demo._stop([gateway])


def test_stop_takes_the_services_down_in_reverse_start_order_gateway_first(tmp_path):
    log = tmp_path / "stopped"
    names = ["store", "worker", "gateway"]  # the order main() starts them in
    services = [
        subprocess.Popen([sys.executable, "-c", SERVICE, str(log), n], stdout=subprocess.PIPE, text=True)
        for n in names
    ]
    for service in services:
        assert service.stdout.readline() == "ready\n"
    demo._stop(services)
    assert log.read_text().split() == ["gateway", "worker", "store"]
    assert [s.returncode for s in services] == [0, 0, 0]
