"""BlobStore: content-addressed files that survive SIGKILL whole or not at all."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adapter_store.blobs import BlobStore
from shared.adapter_blob import digest
from shared.errors import NotFound

REPO = Path(__file__).resolve().parents[2]

# Writes distinct 1 MiB blobs until killed; says "ready" once the first one is stored.
WRITER = """
import os, sys
from pathlib import Path
from adapter_store.blobs import BlobStore
store = BlobStore(Path(sys.argv[1]))
store.put(os.urandom(1 << 20))
print("ready", flush=True)
while True:
    store.put(os.urandom(1 << 20))
"""


def _temp_files(root: Path) -> list[Path]:
    return [path for path in (root / "sha256").iterdir() if path.name.startswith(".")]


def test_put_open_round_trip(tmp_path):
    store = BlobStore(tmp_path)
    blob = b"adapter bytes" * 1000
    d = store.put(blob)
    assert d == digest(blob)
    with store.open(d) as f:
        assert f.read() == blob
    assert store.exists(d) and store.size(d) == len(blob) and store.verify(d)
    assert store.digests() == {d}
    assert (tmp_path / "sha256" / d.removeprefix("sha256:")).read_bytes() == blob


def test_put_is_idempotent(tmp_path):
    store = BlobStore(tmp_path)
    assert store.put(b"same") == store.put(b"same")
    assert len(store.digests()) == 1
    assert _temp_files(tmp_path) == []


def test_leftover_temp_file_is_removed_at_start_and_never_listed(tmp_path):
    (tmp_path / "sha256").mkdir()
    (tmp_path / "sha256" / ".tmp-killed").write_bytes(b"half a blob")
    store = BlobStore(tmp_path)
    assert _temp_files(tmp_path) == []
    (tmp_path / "sha256" / ".tmp-writing").write_bytes(b"in flight")
    d = store.put(b"whole")
    assert store.digests() == {d}


@pytest.mark.parametrize(
    "bad",
    [
        "sha256:../../etc/passwd",
        "sha256:" + "../" * 21 + "x",
        "sha256:" + "A" * 64,
        "sha256:" + "0" * 63,
        "md5:" + "0" * 64,
        "/etc/passwd",
        "",
    ],
)
def test_malformed_digest_is_not_found(tmp_path, bad):
    store = BlobStore(tmp_path)
    with pytest.raises(NotFound, match="not found"):
        store.open(bad)
    with pytest.raises(NotFound):
        store.size(bad)
    assert not store.exists(bad)


def test_unknown_digest_is_not_found(tmp_path):
    store = BlobStore(tmp_path)
    unknown = digest(b"never stored")
    with pytest.raises(NotFound, match=unknown):
        store.open(unknown)
    assert not store.exists(unknown)
    store.delete(unknown)


def test_open_reader_survives_delete(tmp_path):
    store = BlobStore(tmp_path)
    blob = bytes(range(256)) * 4096
    d = store.put(blob)
    with store.open(d) as f:
        head = f.read(1000)
        store.delete(d)
        assert not store.exists(d) and store.digests() == set()
        assert head + f.read() == blob
    with pytest.raises(NotFound):
        store.open(d)


def test_verify_detects_corruption(tmp_path):
    store = BlobStore(tmp_path)
    d = store.put(b"x" * 100_000)
    path = tmp_path / "sha256" / d.removeprefix("sha256:")
    path.write_bytes(b"x" * 99_999 + b"y")
    assert not store.verify(d)


def test_sigkill_mid_write_leaves_only_whole_blobs(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline() == "ready\n"
        time.sleep(0.3)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
    store = BlobStore(tmp_path)
    stored = store.digests()
    assert len(stored) > 1
    assert all(store.verify(d) for d in stored)
    assert _temp_files(tmp_path) == []
