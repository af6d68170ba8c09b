"""Serving over gRPC against the in-process engine, on the default model:
- tokens/s of 32 concurrent greedy streams (8 distinct rank-16 adapters) through a real store and
  worker process, against Engine.generate on the same requests in this process;
- time to first token for a request whose adapter is cold (fetched from the store, loaded,
  activated) against one whose adapter is resident.
Rounds alternate between the two sides; medians are printed.

    .venv/bin/python -m bench.grpc_serving [--repeats 3]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.random_adapter import write_random_adapter
from inference_service.default_model import prepare_default_model
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc

STREAMS, ADAPTERS, RANK, PROMPT, TOKENS = 32, 8, 16, 32, 32
ENGINE = {
    "max_loras": ADAPTERS,
    "max_lora_rank": RANK,
    "max_cpu_loras": 2 * ADAPTERS,
    "max_num_seqs": STREAMS,
}


def start(module: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return process, process.stdout.readline().split()[-1]


def wait_ready(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest(service="readiness")).status != 1:
            time.sleep(0.2)


def requests() -> list[tuple[str, list[int]]]:
    return [(f"r16-{i % ADAPTERS}", [100 + i] * PROMPT) for i in range(STREAMS)]


def in_process_rate(engine: Engine) -> float:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    batch = [Request(ids, adapter, params) for adapter, ids in requests()]
    start_t = time.perf_counter()
    outputs = engine.generate(batch)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start_t)


def stream(stub, adapter: str, ids: list[int], max_tokens: int) -> tuple[int, float]:
    """(tokens received, seconds to the first token)."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(adapter=adapter, token_ids=pb.TokenIds(ids=ids), sampling=params)
    start_t, first, tokens = time.perf_counter(), None, 0
    for response in stub.Generate(request, timeout=600):
        if response.delta.token_ids and first is None:
            first = time.perf_counter() - start_t
        tokens += len(response.delta.token_ids)
    return tokens, first


def grpc_rate(stub) -> float:
    start_t = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        counts = list(pool.map(lambda r: stream(stub, r[0], r[1], TOKENS)[0], requests()))
    return sum(counts) / (time.perf_counter() - start_t)


def cold_and_resident_ttft(stub, admin, folder: Path, i: int) -> tuple[float, float]:
    name = f"cold-{i}"
    admin.RegisterAdapter(store_pb.RegisterAdapterRequest(adapter_id=name, source_uri=f"file://{folder}"))
    cold = stream(stub, name, [7] * PROMPT, 1)[1]
    resident = stream(stub, name, [8] * PROMPT, 1)[1]
    return cold, resident


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache")).resolve()
    model_dir = prepare_default_model(cache)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        model = ModelConfig.from_dir(model_dir)
        folders = [write_random_adapter(model, root / f"r16-{i}", RANK, seed=i) for i in range(ADAPTERS + 4)]
        engine = Engine(EngineConfig(model=str(model_dir), kv_cache_tokens=STREAMS * 96, **ENGINE))
        for folder in folders[:ADAPTERS]:
            engine.add_adapter(folder.name, folder)
        store, store_address = start(
            "adapter_store", "--data-dir", f"{tmp}/store", "--allowed-root", str(root)
        )
        worker_flags = ["--store", store_address, "--model", str(model_dir), "--max-loras", str(ADAPTERS)]
        worker_flags += ["--max-cpu-loras", str(2 * ADAPTERS), "--kv-cache-tokens", str(STREAMS * 96 + 512)]
        worker, address = start("inference_service", *worker_flags, env={"LORAMUX_CACHE": f"{tmp}/worker"})
        try:
            wait_ready(address)
            report(measure(engine, address, store_address, folders, args.repeats), args.repeats)
        finally:
            worker.terminate()
            store.terminate()
            worker.wait()
            store.wait()


def measure(engine: Engine, address: str, store_address: str, folders: list[Path], repeats: int) -> dict:
    with grpc.insecure_channel(address) as channel, grpc.insecure_channel(store_address) as store_channel:
        stub, admin = pb_grpc.InferenceServiceStub(channel), store_grpc.AdapterStoreStub(store_channel)
        for folder in folders[:ADAPTERS]:
            request = store_pb.RegisterAdapterRequest(adapter_id=folder.name, source_uri=f"file://{folder}")
            admin.RegisterAdapter(request)
        results: dict[str, list[float]] = {"in-process": [], "grpc": [], "cold": [], "resident": []}
        grpc_rate(stub)  # warm-up: adapters fetched and resident
        in_process_rate(engine)
        for i in range(repeats):
            results["in-process"].append(in_process_rate(engine))
            results["grpc"].append(grpc_rate(stub))
            cold, resident = cold_and_resident_ttft(stub, admin, folders[ADAPTERS + i % 4], i)
            results["cold"].append(cold)
            results["resident"].append(resident)
    return {name: statistics.median(values) for name, values in results.items()}


def report(m: dict, repeats: int) -> None:
    print(
        f"default model, {STREAMS} streams x ({PROMPT} prompt + {TOKENS} new tokens), {ADAPTERS} distinct "
        f"rank-{RANK} adapters, median of {repeats}"
    )
    print(f"in-process engine tok/s:   {m['in-process']:8.1f}")
    print(f"gRPC, 32 streams tok/s:    {m['grpc']:8.1f}")
    print(f"ratio gRPC / in-process:   {m['grpc'] / m['in-process']:8.3f}")
    print(f"TTFT cold adapter:         {m['cold'] * 1000:8.1f} ms")
    print(f"TTFT resident adapter:     {m['resident'] * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
