"""A real adapter store process on loopback, a real S3 API (moto's server) beside it, and stubs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from adapter_store.catalog import AdapterRecord
from shared.adapter_blob import digest
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "s3cret"
BUCKET = "adapters"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class StoreProcess:
    """`python -m adapter_store` on a free loopback port."""

    def __init__(self, data_dir: Path, flags: list[str], listen: str = "127.0.0.1:0"):
        self.data_dir, self.flags, self.listen = data_dir, flags, listen
        self.process: subprocess.Popen | None = None
        self.address = ""

    def start(self) -> "StoreProcess":
        listen = ["--listen", self.listen, "--data-dir", str(self.data_dir)]
        self.log = self.data_dir.with_name(self.data_dir.name + ".log")
        self.process, self.address = spawn("adapter_store", [*listen, *self.flags], AWS_ENV, self.log)
        return self

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(timeout=15)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=15)


def spawn(module: str, args: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m module args`, stderr appended to `log`; returns it and the address it printed
    ("... listening on HOST:PORT") once it listens."""
    with open(log, "a") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    line = process.stdout.readline()
    if "listening on" not in line:
        process.wait(timeout=15)
        raise RuntimeError(f"{module} did not start:\n{log.read_text()[-3000:]}")
    return process, line.split()[-1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's ThreadedMotoServer: a real S3 HTTP API on loopback, with one bucket."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3(endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def s3(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, **_aws_kwargs())


def _aws_kwargs() -> dict:
    return {
        "aws_access_key_id": AWS_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": AWS_ENV["AWS_DEFAULT_REGION"],
    }


def upload_folder(endpoint: str, folder: Path, prefix: str) -> str:
    """Every file of `folder` under s3://BUCKET/prefix/; returns that uri."""
    client = s3(endpoint)
    for path in folder.iterdir():
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def sources_root(tmp_path_factory, tiny_adapters) -> Path:
    """The one folder file:// sources may come from, holding copies of the tiny llama adapters."""
    root = tmp_path_factory.mktemp("sources")
    for name, folder in tiny_adapters["llama"].items():
        shutil.copytree(folder, root / name)
    return root


def local_store_flags(sources: Path, base_model: Path) -> list[str]:
    """A store reading adapters from `sources` alone, checking them against `base_model`, its admin
    RPCs behind ADMIN_TOKEN."""
    return ["--allowed-root", str(sources), "--base-model", str(base_model), "--admin-token", ADMIN_TOKEN]


def store_flags(sources_root: Path, s3_endpoint: str, tiny_models, *extra: str) -> list[str]:
    return [
        "--allowed-root",
        str(sources_root),
        "--s3-endpoint",
        s3_endpoint,
        "--s3-allowed-bucket",
        BUCKET,
        "--admin-token",
        ADMIN_TOKEN,
        "--base-model",
        str(tiny_models["llama"]),
        "--max-lora-rank",
        "16",
        *extra,
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory, sources_root, s3_endpoint, tiny_models):
    process = StoreProcess(
        tmp_path_factory.mktemp("store"), store_flags(sources_root, s3_endpoint, tiny_models)
    ).start()
    yield process
    assert process.stop() == 0


@pytest.fixture
def stub(store):
    with grpc.insecure_channel(store.address) as channel:
        yield pb_grpc.AdapterStoreStub(channel)


AUTH = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


def record(adapter_id: str, content: bytes = b"blob", pinned: bool = False) -> AdapterRecord:
    """A catalog record of `content` (only its digest and size are real)."""
    return AdapterRecord(
        adapter_id=adapter_id,
        digest=digest(content),
        rank=8,
        alpha=16.0,
        target_modules=("q_proj", "v_proj"),
        size_bytes=len(content),
        dtype="float32",
        source_uri=f"file:///adapters/{adapter_id}",
        pinned=pinned,
        created_at=1_700_000_000.5,
    )
