"""Adapter registration and fetch against reading the same bytes: a rank-16 all-linear adapter
of the default model, registered through a real store process from disk and from S3 (moto's
server on loopback), beside a plain read of its files from each; and fetched from the store as a
worker does (StoreAdapterLoader: stream, digest check, decode), beside a plain read of the
store's blob file. Medians of several runs, interleaved.

    .venv/bin/python -m bench.store_register [--repeats 5]
"""

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import boto3
import grpc
import torch
from moto.server import ThreadedMotoServer

from bench.cache import default_model_dir
from bench.local_stack import start
from bench.random_adapter import write_random_adapter
from inference_service.adapters.store_loader import StoreAdapterLoader
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

BUCKET, RANK = "bench", 16
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def register_vs_read(
    model_dir: Path, repeats: int = 5, progress: Callable[[str], None] = lambda line: None
) -> dict:
    """Seconds per round of each case (register / read, from disk / S3) and their ratios."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    endpoint = "http://{}:{}".format(*moto.get_host_and_port())
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=AWS["AWS_DEFAULT_REGION"],
    )
    s3.create_bucket(Bucket=BUCKET)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sources"
        folder = write_random_adapter(ModelConfig.from_dir(model_dir), root / "r16", RANK, seed=0)
        files = sorted(folder.iterdir())
        for path in files:
            s3.upload_file(str(path), BUCKET, f"r16/{path.name}")
        size = sum(p.stat().st_size for p in files)
        flags = [
            "--data-dir",
            str(Path(tmp) / "data"),
            "--allowed-root",
            str(root),
            "--s3-endpoint",
            endpoint,
        ]
        flags += ["--s3-allowed-bucket", BUCKET, "--base-model", str(model_dir)]
        process, address = start("adapter_store", *flags, env=AWS)
        try:
            with grpc.insecure_channel(address) as channel:
                times = run(pb_grpc.AdapterStoreStub(channel), s3, folder, files, repeats, progress)
                times |= fetch(channel, Path(tmp), model_dir, repeats, progress)
        finally:
            process.terminate()
            process.wait()
    moto.stop()
    return summary(times, size, repeats)


def run(
    stub, s3, folder: Path, files: list[Path], repeats: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    def register(uri: str, i: int):
        return lambda: stub.RegisterAdapter(pb.RegisterAdapterRequest(adapter_id=f"a{i}", source_uri=uri))

    cases = {
        "read from disk": lambda i: lambda: [p.read_bytes() for p in files],
        "register from disk": lambda i: register(f"file://{folder}", i),
        "read from S3": lambda i: (
            lambda: [s3.get_object(Bucket=BUCKET, Key=f"r16/{p.name}")["Body"].read() for p in files]
        ),
        "register from S3": lambda i: register(f"s3://{BUCKET}/r16", i),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):  # round 0 warms up and is dropped
        progress(f"registration round {i}/{repeats}" if i else "registration warm-up round")
        for name, case in cases.items():
            took = timed(case(i))
            if i:
                times[name].append(took)
    return times


def fetch(
    channel: grpc.Channel, tmp: Path, model_dir: Path, repeats: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    """A worker's fetch of the registered adapter a0 into an empty cache (stream, verify, decode),
    and a plain read of the store's blob file, back to back per round."""
    blob = next(p for p in (tmp / "data" / "blobs").rglob("*") if p.is_file())
    model = ModelConfig.from_dir(model_dir)

    def worker_fetch(i: int) -> None:
        StoreAdapterLoader(channel, tmp / f"worker-{i}", model, RANK, torch.float32).load("a0")

    times: dict[str, list[float]] = {"fetch store -> worker": [], "read the store's blob": []}
    for i in range(repeats + 1):
        progress(f"fetch round {i}/{repeats}" if i else "fetch warm-up round")
        took = (timed(partial(worker_fetch, i)), timed(blob.read_bytes))
        if i:
            times["fetch store -> worker"].append(took[0])
            times["read the store's blob"].append(took[1])
    return times


def summary(times: dict[str, list[float]], size: int, repeats: int) -> dict:
    """Medians, and per source the median of per-round register/read ratios (a round times
    both back to back)."""
    median = {name: statistics.median(t) for name, t in times.items()}
    ratios = {
        source: [
            reg / read
            for reg, read in zip(times[f"register from {source}"], times[f"read from {source}"], strict=True)
        ]
        for source in ("disk", "S3")
    }
    ratios["fetch"] = [
        f / r for f, r in zip(times["fetch store -> worker"], times["read the store's blob"], strict=True)
    ]
    table = [
        {
            "case": f"register from {source}, median",
            "ms": round(median[f"register from {source}"] * 1e3, 1),
            "baseline": f"read of the same files from {source}, median",
            "baseline ms": round(median[f"read from {source}"] * 1e3, 1),
            "ratio": round(statistics.median(ratios[source]), 2),
        }
        for source in ("disk", "S3")
    ]
    table.append(
        {
            "case": "fetch store -> worker (stream, verify, decode), median",
            "ms": round(median["fetch store -> worker"] * 1e3, 1),
            "baseline": "read of the store's blob file, median",
            "baseline ms": round(median["read the store's blob"] * 1e3, 1),
            "ratio": round(statistics.median(ratios["fetch"]), 2),
        }
    )
    return {
        "setup": (
            f"a rank-{RANK} all-linear adapter of the default model ({size / 1e6:.1f} MB of safetensors) "
            f"registered through a real store process (validate, optimize, write content-addressed) "
            f"beside a plain read of the same files; S3 is moto's server on loopback; a worker's fetch "
            f"of the optimized blob into an empty cache (StoreAdapterLoader over gRPC: stream, sha256 "
            f"check, decode) beside a plain read of the store's blob file; medians of {repeats} "
            f"interleaved rounds after a dropped warm-up round"
        ),
        "table": table,
        "adapter_bytes": size,
        "seconds": times,
        "register_over_read": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = register_vs_read(model_dir, args.repeats)
    print(result["setup"])
    for name, seconds in result["seconds"].items():
        print(f"{name:20s} {statistics.median(seconds) * 1000:8.1f} ms")
    for row in result["table"]:
        print(f"{row['case']} / read: {row['ratio']:6.1f}x")


if __name__ == "__main__":
    main()
