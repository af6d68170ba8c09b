"""Checkpoint sources: a folder under an allowed root or a prefix in an allowed bucket is copied byte
for byte; anything outside what the store may read, a pickle, an oversize file or an unreachable
endpoint is refused with the right error class and a message naming the thing at fault.

S3 runs against moto's server: the real S3 HTTP API on loopback, through boto3 as in production."""

import json
import pickle
import re
import shutil
import time
import types
from pathlib import Path

import boto3
import botocore.endpoint
import pytest
import torch
from moto.server import ThreadedMotoServer

from adapter_store.__main__ import parse_config
from adapter_store.config import StoreConfig
from adapter_store.sources import CONFIG_BYTES, Sources
from shared.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from shared.peft_checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from tests.model_shapes import QWEN3_30B_A3B_CONFIG

CHECKPOINT = (CONFIG_FILE, WEIGHTS_FILE)
# moto keeps one S3 state per process, shared with other modules' servers: a bucket of our own.
BUCKET = "source-tests"
UNREACHABLE = "http://127.0.0.1:1"


class Payload:
    """Unpickling it creates the marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def dest(tmp_path) -> Path:
    (tmp_path / "dest").mkdir()
    return tmp_path / "dest"


@pytest.fixture
def checkpoint(tiny_adapters, root) -> Path:
    """A good rank-4 q/v PEFT adapter folder under the allowed root."""
    return Path(shutil.copytree(tiny_adapters["llama"]["qv4"], root / "qv4"))


@pytest.fixture
def outside(tiny_adapters, tmp_path) -> Path:
    """A good adapter folder outside the allowed root."""
    return Path(shutil.copytree(tiny_adapters["llama"]["qv4"], tmp_path / "outside"))


def _config(tmp_path: Path, **overrides) -> StoreConfig:
    fields = dict(data_dir=tmp_path / "data", allowed_roots=(tmp_path / "root",))
    return StoreConfig(**{**fields, **overrides})


def _fetch(uri: str, config: StoreConfig, dest: Path) -> str:
    return Sources(config).fetch(uri, dest, "adapter 'x'")


def _assert_copied(dest: Path, source: Path) -> None:
    assert sorted(p.name for p in dest.iterdir()) == sorted(CHECKPOINT)
    for name in CHECKPOINT:
        assert (dest / name).read_bytes() == (source / name).read_bytes()


def _named(*parts) -> str:
    """A regex matching the parts in order, paths taken literally."""
    return ".*".join(re.escape(str(part)) for part in parts)


# --- file:// ---------------------------------------------------------------------------------


def test_local_copy_is_byte_identical_and_loads(checkpoint, root, tmp_path, dest):
    assert _fetch(f"file://{root}/sub/../qv4/", _config(tmp_path), dest) == f"file://{checkpoint.resolve()}"
    _assert_copied(dest, checkpoint)
    assert load_peft_adapter("x", dest, None, None, torch.float32).rank == 4


def test_local_symlinks_inside_the_roots_are_followed(checkpoint, root, tmp_path, dest):
    # The Hugging Face cache lays snapshots out as symlinks to blobs elsewhere in the cache.
    (root / "snapshot").mkdir()
    for name in CHECKPOINT:
        (root / "snapshot" / name).symlink_to(checkpoint / name)
    _fetch(f"file://{root}/snapshot", _config(tmp_path), dest)
    _assert_copied(dest, checkpoint)


def test_local_dotdot_escape_is_denied(outside, root, tmp_path, dest):
    with pytest.raises(PermissionDenied, match=_named(outside, "outside the allowed roots")):
        _fetch(f"file://{root}/../outside", _config(tmp_path), dest)


def test_local_symlinked_folder_escaping_the_roots_is_denied(outside, root, tmp_path, dest):
    (root / "link").symlink_to(outside)
    with pytest.raises(PermissionDenied, match=_named(root / "link", "resolves to", outside, "outside")):
        _fetch(f"file://{root}/link", _config(tmp_path), dest)


def test_local_symlinked_file_escaping_the_roots_is_denied(checkpoint, tmp_path, dest):
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    (checkpoint / WEIGHTS_FILE).unlink()
    (checkpoint / WEIGHTS_FILE).symlink_to(secret)
    with pytest.raises(PermissionDenied, match=_named(WEIGHTS_FILE, "resolves to", secret, "outside")):
        _fetch(f"file://{checkpoint}", _config(tmp_path), dest)
    assert not (dest / WEIGHTS_FILE).exists()


def test_local_sources_are_denied_without_allowed_roots(checkpoint, tmp_path, dest):
    with pytest.raises(PermissionDenied, match=r"no --allowed-root is configured"):
        _fetch(f"file://{checkpoint}", _config(tmp_path, allowed_roots=()), dest)


def test_local_relative_path_is_invalid(checkpoint, tmp_path, dest):
    with pytest.raises(InvalidArgument, match=r"'file://root/qv4' must name an absolute path"):
        _fetch("file://root/qv4", _config(tmp_path), dest)


def test_local_missing_folder_is_not_found(root, tmp_path, dest):
    with pytest.raises(NotFound, match=_named(root / "nope", "does not exist")):
        _fetch(f"file://{root}/nope", _config(tmp_path), dest)


def test_local_missing_config_is_invalid(checkpoint, tmp_path, dest):
    (checkpoint / CONFIG_FILE).unlink()
    with pytest.raises(InvalidArgument, match=_named(checkpoint, "has no", CONFIG_FILE)):
        _fetch(f"file://{checkpoint}", _config(tmp_path), dest)


def test_local_missing_weights_is_invalid(checkpoint, tmp_path, dest):
    (checkpoint / WEIGHTS_FILE).unlink()
    with pytest.raises(InvalidArgument, match=_named(checkpoint, "has no", WEIGHTS_FILE)):
        _fetch(f"file://{checkpoint}", _config(tmp_path), dest)


def test_local_pickle_checkpoint_is_refused_and_never_unpickled(checkpoint, tmp_path, dest):
    marker = tmp_path / "pwned"
    (checkpoint / WEIGHTS_FILE).unlink()
    (checkpoint / "adapter_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InvalidArgument, match=r"adapter_model\.bin is a pickle checkpoint"):
        _fetch(f"file://{checkpoint}", _config(tmp_path), dest)
    assert not marker.exists()
    assert not any(dest.iterdir())


def test_local_oversize_file_is_refused(checkpoint, tmp_path, dest):
    limit = (checkpoint / CONFIG_FILE).stat().st_size
    size = (checkpoint / WEIGHTS_FILE).stat().st_size
    with pytest.raises(InvalidArgument, match=_named(WEIGHTS_FILE, f"is {size} bytes", f"{limit} bytes")):
        _fetch(f"file://{checkpoint}", _config(tmp_path, max_adapter_bytes=limit), dest)
    assert not (dest / WEIGHTS_FILE).exists()


def test_a_config_past_its_own_bound_is_refused_unread(checkpoint, tmp_path, dest):
    """The config is parsed whole in memory: it has a bound of its own, below the weights'."""
    with open(checkpoint / CONFIG_FILE, "a") as f:
        f.write(" " * CONFIG_BYTES)  # still valid JSON
    size = (checkpoint / CONFIG_FILE).stat().st_size
    limit = _config(tmp_path).max_adapter_bytes
    assert limit > size
    with pytest.raises(
        InvalidArgument, match=_named(CONFIG_FILE, f"is {size} bytes", f"{CONFIG_BYTES} bytes")
    ):
        _fetch(f"file://{checkpoint}", _config(tmp_path), dest)
    assert not (dest / CONFIG_FILE).exists()


def test_the_default_limit_takes_any_adapter_of_max_lora_rank_on_the_base_model(tmp_path):
    """On Qwen3-30B-A3B a rank-16 adapter on every module is 1.7 GB in bfloat16; the default
    takes rank 64 in float32, the embedding and head with PEFT's base copies too
    (shared/blob_limit.py), and 1 GiB stays the least it is."""
    base = tmp_path / "qwen3-30b-a3b"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    flags = ["--data-dir", str(tmp_path / "data"), "--base-model", str(base)]
    assert parse_config(flags).max_adapter_bytes == 16_105_989_632
    assert parse_config([*flags, "--max-lora-rank", "16"]).max_adapter_bytes == 5_900_707_328
    assert parse_config([*flags, "--max-adapter-bytes", "5000"]).max_adapter_bytes == 5000
    assert parse_config(flags[:2]).max_adapter_bytes == 1 << 30
    with pytest.raises(InvalidArgument, match="max_adapter_bytes must not be negative, got -1"):
        _config(tmp_path, max_adapter_bytes=-1)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_local_copy_stops_at_the_limit_when_more_bytes_arrive(checkpoint, tmp_path, dest):
    # /proc files stat as 0 bytes yet stream more: a stand-in for a file growing during the copy.
    (checkpoint / WEIGHTS_FILE).unlink()
    (checkpoint / WEIGHTS_FILE).symlink_to("/proc/self/maps")
    limit = (checkpoint / CONFIG_FILE).stat().st_size
    config = _config(tmp_path, allowed_roots=(tmp_path / "root", Path("/proc")), max_adapter_bytes=limit)
    with pytest.raises(InvalidArgument, match=_named(WEIGHTS_FILE, f"is more than {limit} bytes")):
        _fetch(f"file://{checkpoint}", config, dest)
    assert (dest / WEIGHTS_FILE).stat().st_size <= limit


@pytest.mark.parametrize("uri", ["http://example.com/qv4", "relative/qv4", "", "/abs/qv4", "ftp://h/qv4"])
def test_unsupported_schemes_are_invalid(uri, tmp_path, dest):
    with pytest.raises(
        InvalidArgument, match=_named(f"source uri '{uri}' is not supported", "file://", "s3://")
    ):
        _fetch(uri, _config(tmp_path), dest)


# --- s3:// -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aws_env():
    """Test credentials in the environment, where boto3 finds them by default."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        yield


@pytest.fixture(scope="module")
def s3_server(aws_env):
    """moto's server: the real S3 HTTP API on loopback."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def bucket(s3_server, tiny_adapters, tmp_path_factory) -> Path:
    """BUCKET holding a good adapter under good/ and at the top, a pickle-only checkpoint under
    pickled/ and one without its config under noconfig/. Returns the good adapter's folder."""
    qv4 = tiny_adapters["llama"]["qv4"]
    pickled = pickle.dumps(Payload(tmp_path_factory.mktemp("s3") / "pwned"))
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=BUCKET)
    for key, body in {
        **{f"good/{name}": (qv4 / name).read_bytes() for name in CHECKPOINT},
        **{name: (qv4 / name).read_bytes() for name in CHECKPOINT},
        f"pickled/{CONFIG_FILE}": (qv4 / CONFIG_FILE).read_bytes(),
        "pickled/adapter_model.bin": pickled,
        f"noconfig/{WEIGHTS_FILE}": (qv4 / WEIGHTS_FILE).read_bytes(),
    }.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    return qv4


def _s3_config(tmp_path: Path, endpoint: str, **overrides) -> StoreConfig:
    fields = dict(s3_endpoint=endpoint, s3_allowed_buckets=(BUCKET, "missing"), s3_timeout_s=1.0)
    return _config(tmp_path, **{**fields, **overrides})


@pytest.mark.parametrize(
    ("uri", "recorded"),
    [
        (f"s3://{BUCKET}/good", f"s3://{BUCKET}/good"),
        (f"s3://{BUCKET}/good/", f"s3://{BUCKET}/good"),
        (f"s3://{BUCKET}", f"s3://{BUCKET}"),
        (f"s3://{BUCKET}/", f"s3://{BUCKET}"),
    ],
)
def test_s3_copy_is_byte_identical(uri, recorded, bucket, s3_server, tmp_path, dest):
    assert _fetch(uri, _s3_config(tmp_path, s3_server), dest) == recorded
    _assert_copied(dest, bucket)


def test_s3_bucket_not_allowed_is_denied_without_a_network_call(aws_env, tmp_path, dest):
    # The endpoint is unreachable, so any call to it would end in Unavailable instead.
    with pytest.raises(PermissionDenied, match=r"bucket 'elsewhere' is not one of the allowed buckets"):
        _fetch("s3://elsewhere/good", _s3_config(tmp_path, UNREACHABLE), dest)


def test_s3_missing_bucket_is_not_found(s3_server, tmp_path, dest):
    with pytest.raises(NotFound, match=r"bucket 'missing' does not exist"):
        _fetch("s3://missing/good", _s3_config(tmp_path, s3_server), dest)


def test_s3_missing_prefix_is_invalid(bucket, s3_server, tmp_path, dest):
    with pytest.raises(InvalidArgument, match=rf"s3://{BUCKET}/nope has no {WEIGHTS_FILE}"):
        _fetch(f"s3://{BUCKET}/nope", _s3_config(tmp_path, s3_server), dest)


def test_s3_missing_config_is_invalid(bucket, s3_server, tmp_path, dest):
    with pytest.raises(InvalidArgument, match=rf"s3://{BUCKET}/noconfig has no {CONFIG_FILE}"):
        _fetch(f"s3://{BUCKET}/noconfig", _s3_config(tmp_path, s3_server), dest)


def test_s3_pickle_checkpoint_is_refused_and_never_fetched(bucket, s3_server, tmp_path, dest):
    with pytest.raises(InvalidArgument, match=r"adapter_model.bin is a pickle checkpoint"):
        _fetch(f"s3://{BUCKET}/pickled", _s3_config(tmp_path, s3_server), dest)
    assert not any(dest.iterdir())


def test_s3_oversize_file_is_refused(bucket, s3_server, tmp_path, dest):
    limit = (bucket / CONFIG_FILE).stat().st_size
    size = (bucket / WEIGHTS_FILE).stat().st_size
    config = _s3_config(tmp_path, s3_server, max_adapter_bytes=limit)
    with pytest.raises(InvalidArgument, match=rf"{WEIGHTS_FILE} is {size} bytes, above .* {limit} bytes"):
        _fetch(f"s3://{BUCKET}/good", config, dest)


def test_s3_unreachable_endpoint_is_unavailable(aws_env, tmp_path, dest, monkeypatch):
    # max_attempts=5 counts retries: 6 attempts with exponential backoff between them, seconds
    # in all. The test keeps the attempts and skips the waits.
    waits = []
    monkeypatch.setattr(botocore.endpoint, "time", types.SimpleNamespace(sleep=waits.append))
    start = time.monotonic()
    with pytest.raises(Unavailable, match=rf"S3 endpoint {UNREACHABLE} is unavailable"):
        _fetch(f"s3://{BUCKET}/good", _s3_config(tmp_path, UNREACHABLE, s3_timeout_s=0.5), dest)
    assert len(waits) == 5
    assert time.monotonic() - start < 5
