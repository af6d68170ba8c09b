"""Serving over gRPC against the in-process engine, on the default model:
- tokens/s of 32 concurrent greedy streams (8 distinct rank-16 adapters) through the SDK
  (`loramux.Client`) to a real store and worker process, against Engine.generate on the same
  requests in this process;
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import loramux
from bench.random_adapter import write_random_adapter
from inference_service.default_model import prepare_default_model
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

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


def stream(client: loramux.Client, adapter: str, ids: list[int], max_tokens: int) -> tuple[int, float]:
    """(tokens received, seconds to the first token), as the caller sees them."""
    start_t, first, tokens = time.perf_counter(), None, 0
    deltas = client.generate(
        token_ids=ids, adapter=adapter, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=600
    )
    for delta in deltas:
        if delta.token_ids and first is None:
            first = time.perf_counter() - start_t
        tokens += len(delta.token_ids)
    return tokens, first


def grpc_rate(client: loramux.Client) -> float:
    start_t = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        counts = list(pool.map(lambda r: stream(client, r[0], r[1], TOKENS)[0], requests()))
    return sum(counts) / (time.perf_counter() - start_t)


def cold_and_resident_ttft(client: loramux.Client, folder: Path, i: int) -> tuple[float, float]:
    name = f"cold-{i}"
    client.register_adapter(name, f"file://{folder}")
    cold = stream(client, name, [7] * PROMPT, 1)[1]
    resident = stream(client, name, [8] * PROMPT, 1)[1]
    return cold, resident


def grpc_vs_in_process(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None
) -> dict:
    """Tokens/s over gRPC and in process, TTFT cold and resident: per round, medians, ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        model = ModelConfig.from_dir(model_dir)
        # one fresh adapter per round for the cold TTFT: the worker caches blobs by digest
        count = ADAPTERS + repeats
        folders = [write_random_adapter(model, root / f"r16-{i}", RANK, seed=i) for i in range(count)]
        engine = Engine(EngineConfig(model=str(model_dir), kv_cache_tokens=STREAMS * 96, **ENGINE))
        for folder in folders[:ADAPTERS]:
            engine.add_adapter(folder.name, folder)
        progress("starting a store and a worker")
        store, store_address = start(
            "adapter_store", "--data-dir", f"{tmp}/store", "--allowed-root", str(root)
        )
        worker_flags = ["--store", store_address, "--model", str(model_dir), "--max-loras", str(ADAPTERS)]
        worker_flags += ["--max-cpu-loras", str(2 * ADAPTERS), "--kv-cache-tokens", str(STREAMS * 96 + 512)]
        worker, address = start("inference_service", *worker_flags, env={"LORAMUX_CACHE": f"{tmp}/worker"})
        try:
            wait_ready(address)
            with loramux.Client(worker=address, store=store_address) as client:
                return summary(measure(engine, client, folders, repeats, progress), repeats)
        finally:
            worker.terminate()
            store.terminate()
            worker.wait()
            store.wait()


def measure(
    engine: Engine, client: loramux.Client, folders: list[Path], repeats: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    client.model_info()  # opens the worker's channel before 32 threads share it
    for folder in folders[:ADAPTERS]:
        client.register_adapter(folder.name, f"file://{folder}")
    results: dict[str, list[float]] = {"in-process": [], "grpc": [], "cold": [], "resident": []}
    progress("warm-up round")
    grpc_rate(client)  # adapters fetched and resident
    in_process_rate(engine)
    for i in range(repeats):
        progress(f"round {i + 1}/{repeats}")
        results["in-process"].append(in_process_rate(engine))
        results["grpc"].append(grpc_rate(client))
        cold, resident = cold_and_resident_ttft(client, folders[ADAPTERS + i], i)
        results["cold"].append(cold)
        results["resident"].append(resident)
    return results


def summary(results: dict[str, list[float]], repeats: int) -> dict:
    """Medians, and the medians of per-round ratios (each round times both sides back to back)."""
    ratios = {
        "grpc": [g / p for g, p in zip(results["grpc"], results["in-process"], strict=True)],
        "cold": [c / r for c, r in zip(results["cold"], results["resident"], strict=True)],
    }
    median = {name: statistics.median(values) for name, values in results.items()}
    table = [
        {
            "case": f"{STREAMS} concurrent SDK streams over gRPC, tok/s",
            "value": round(median["grpc"], 1),
            "baseline": "Engine.generate in process, tok/s",
            "baseline value": round(median["in-process"], 1),
            "ratio": round(statistics.median(ratios["grpc"]), 3),
        },
        {
            "case": "TTFT, cold adapter (fetch, load, activate), ms",
            "value": round(median["cold"] * 1e3, 1),
            "baseline": "TTFT, resident adapter, ms",
            "baseline value": round(median["resident"] * 1e3, 1),
            "ratio": round(statistics.median(ratios["cold"]), 2),
        },
    ]
    return {
        "setup": (
            f"default model, {STREAMS} streams x ({PROMPT} prompt + {TOKENS} new tokens), greedy, "
            f"{ADAPTERS} distinct rank-{RANK} adapters, through a store and a worker process on the same "
            f"machine; TTFT of a {PROMPT}-token prompt, 1 new token; medians of {repeats} rounds, each "
            f"timing both sides back to back, after a warm-up round"
        ),
        "table": table,
        "values": results,
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = prepare_default_model(Path(os.environ.get("LORAMUX_CACHE", ".cache")).resolve())
    result = grpc_vs_in_process(model_dir, args.repeats)
    print(result["setup"])
    for row in result["table"]:
        print(f"{row['case']}: {row['value']} against {row['baseline']} {row['baseline value']}")
        print(f"    ratio {row['ratio']}")


if __name__ == "__main__":
    main()
