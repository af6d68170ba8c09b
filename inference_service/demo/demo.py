"""`make run`: the local stack. Starts an adapter store (local disk), an inference worker and the
OpenAI gateway on loopback, registers the demo adapters, streams base and adapter answers to the
same questions concurrently through the SDK, then keeps serving until Ctrl-C."""

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import loramux
from inference_service.default_model import prepare_default_model
from shared import tcmalloc

DEMO_ADAPTERS = Path(__file__).resolve().parent / "demo_adapters"
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?"]
READY_TIMEOUT_S = 180
# Ctrl-C, kill, a closed terminal: the services sit in their own process groups, so these reach
# only this process, which then stops the services in order (_stop).
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store-port", type=int, default=50061)
    parser.add_argument("--worker-port", type=int, default=50051)
    parser.add_argument("--gateway-port", type=int, default=8000, help="a free one if that is taken")
    parser.add_argument("--quantization", default="none", help="the worker's linear weights: int8, nf4")
    parser.add_argument(
        "--tensor-parallel-size",
        default="1",
        help="ranks the worker splits the model over (3 divides its heads)",
    )
    args = parser.parse_args()
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache")).resolve()
    print(f"preparing the default model (SmolLM2-135M-Instruct) under {cache} ...", flush=True)
    model = prepare_default_model(cache)
    store_address, worker_address = f"127.0.0.1:{args.store_port}", f"127.0.0.1:{args.worker_port}"
    processes = [
        _spawn(
            "adapter_store",
            "--listen",
            store_address,
            "--data-dir",
            str(cache / "run" / "store"),
            "--allowed-root",
            str(DEMO_ADAPTERS),
            "--base-model",
            str(model),
        ),
        _spawn(
            "inference_service",
            "--listen",
            worker_address,
            "--store",
            store_address,
            "--model",
            str(model),
            "--max-loras",
            "4",
            "--quantization",
            args.quantization,
            "--tensor-parallel-size",
            args.tensor_parallel_size,
        ),
        _spawn_gateway(args.gateway_port, worker_address, store_address),
    ]
    try:
        _wait_ready(store_address, "")
        _wait_ready(worker_address, "readiness")
        gateway_address = _gateway_address(processes[-1])
        _wait_http_ready(f"http://{gateway_address}/health")
        asyncio.run(_demo(store_address, worker_address))
        _print_usage(store_address, worker_address, gateway_address)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        signal.sigwait(STOP_SIGNALS)
    except KeyboardInterrupt:  # Ctrl-C before serving: the services' stop lines say enough
        sys.exit(130)
    finally:
        _stop(processes)


def _spawn(module: str, *args: str, stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """The services log to stderr; their stdout (one "listening on" line) is not needed here but
    for the gateway's. Each runs in its own process group, so a terminal's Ctrl-C reaches only this
    process, and _stop stops them in order. They allocate with tcmalloc where it is installed."""
    command = [sys.executable, "-m", module, *args]
    env = tcmalloc.preloading(os.environ)
    return subprocess.Popen(command, stdout=stdout, text=True, process_group=0, env=env)


def _spawn_gateway(port: int, worker: str, store: str) -> subprocess.Popen:
    """The demo's store has no admin token, so neither does the gateway (both read one from the
    environment alike). `port` when free, else one the gateway picks: 8000 is a common port."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            port = 0
    listen = f"127.0.0.1:{port}"
    return _spawn(
        "openai_gateway", "--listen", listen, "--worker", worker, "--store", store, stdout=subprocess.PIPE
    )


def _gateway_address(gateway: subprocess.Popen) -> str:
    """HOST:PORT from the gateway's first stdout line, printed once it is bound."""
    line = gateway.stdout.readline()
    found = re.search(r"listening on (\S+)$", line.strip())
    if found is None:
        sys.exit("the openai gateway did not start; see the log above")
    return found.group(1)


def _wait_ready(address: str, service: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.2)
    sys.exit(f"{address} did not become ready in {READY_TIMEOUT_S} s; see the log above")


def _wait_http_ready(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:  # not listening yet, or 503 (an HTTPError) until it has reached the worker
            time.sleep(0.2)
    sys.exit(f"{url} did not answer 200 in {READY_TIMEOUT_S} s; see the log above")


async def _demo(store: str, worker: str) -> None:
    async with loramux.AsyncClient(worker=worker, store=store) as client:
        adapters = sorted(p.name for p in DEMO_ADAPTERS.iterdir() if (p / "adapter_config.json").is_file())
        for name in adapters:
            await _register(client, name)
        print(f"\nregistered demo adapters: {', '.join(adapters)}")
        jobs = [(q, a) for q in QUESTIONS for a in [None, *adapters]]
        print(f"streaming {len(jobs)} answers at once (base model and every adapter) ...\n", flush=True)
        start = time.perf_counter()
        results = await asyncio.gather(*(_answer(client, q, a) for q, a in jobs))
        for (question, adapter), (text, first) in zip(jobs, results, strict=True):
            label = adapter or "base"
            print(f"[{label:>8}] {question}\n           {text.strip()}   (first token {first:.2f} s)\n")
        print(f"{len(jobs)} concurrent streams done in {time.perf_counter() - start:.1f} s")


async def _register(client: loramux.AsyncClient, name: str) -> None:
    uri = f"file://{DEMO_ADAPTERS / name}"
    try:
        await client.register_adapter(name, uri)
    except loramux.AlreadyExists:  # retrained since the last run: serve the new weights
        await client.delete_adapter(name, force=True)
        await client.register_adapter(name, uri)


async def _answer(client: loramux.AsyncClient, question: str, adapter: str | None) -> tuple[str, float]:
    start, first = time.perf_counter(), None
    stream = client.generate(messages=[("user", question)], adapter=adapter, max_tokens=40, temperature=0)
    async for _ in stream:
        first = first or time.perf_counter() - start
    return stream.result.text, first or 0.0


def _print_usage(store: str, worker: str, gateway: str) -> None:
    message = [{"role": "user", "content": "Name three fruits."}]
    body = json.dumps({"model": "shouty", "messages": message, "max_tokens": 40})
    client = f"OpenAI(base_url='http://{gateway}/v1', api_key='unused')"
    create = f"chat.completions.create(model='pirate', messages={message!r}, max_tokens=40)"
    # `openai` is the demo extra: `make run` installs it, a bare `pip install .` does not.
    needs = (
        ""
        if importlib.util.find_spec("openai")
        else "  (needs the openai client: .venv/bin/pip install openai)\n"
    )
    print(
        f"""
serving: worker {worker}, adapter store {store}, OpenAI API http://{gateway}/v1. Try, in another terminal:
  .venv/bin/loramux --worker {worker} generate --chat --adapter shouty "Name three fruits."
  .venv/bin/loramux --store {store} adapters list
  .venv/bin/python -c "import loramux; c = loramux.Client(worker='{worker}'); print(c.complete('Hi').text)"
  curl -s http://{gateway}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'
{needs}  .venv/bin/python -c "from openai import OpenAI; print({client}.{create}.choices[0].message.content)"
Ctrl-C stops the services.""",
        flush=True,
    )


def _stop(processes: list[subprocess.Popen]) -> None:
    """In reverse order of start. The gateway first: its open HTTP requests finish while the worker
    still serves them. Then the worker: it drains and ends its own watch of the store. A store
    stopped beside it would cut that watch while streams drain, and the worker would warn of a lost
    store until done."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a second Ctrl-C must not orphan one
    for process in reversed(processes):  # the gateway, the worker, then the store
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=40)  # the worker's drain takes up to 35 s
        except subprocess.TimeoutExpired:
            process.kill()


if __name__ == "__main__":
    main()
