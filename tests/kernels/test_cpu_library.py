"""Builds of a kernel's source in its folder: a build is marked used each time it loads, and the
same source's builds that nothing has loaded for STALE_AFTER_S are removed then; other sources'
builds and recent ones stay."""

import os
import time

from kernels.cpu_library import STALE_AFTER_S
from kernels.cpu_token_mask import CpuTokenMask


def _aged(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_sources_builds_unused_past_the_limit_go_when_one_loads(tmp_path):
    stale = tmp_path / "cpu_token_mask-0000000000000000.so"  # an earlier version's build
    recent = tmp_path / "cpu_token_mask-1111111111111111.so"  # another target's, loaded lately
    other = tmp_path / "cpu_swiglu-2222222222222222.so"  # another source's
    for path in (stale, recent, other):
        path.write_bytes(b"not a library")
    _aged(stale, STALE_AFTER_S + 60)
    _aged(recent, STALE_AFTER_S / 2)
    _aged(other, STALE_AFTER_S + 60)
    kernel, why = CpuTokenMask.load(tmp_path)
    assert kernel is not None, why
    assert not stale.exists() and recent.exists() and other.exists()
    [built] = set(tmp_path.glob("cpu_token_mask-*.so")) - {recent}

    _aged(built, STALE_AFTER_S + 60)  # loaded long ago: loading it again marks it used
    kernel, why = CpuTokenMask.load(tmp_path)
    assert kernel is not None, why
    assert built.stat().st_mtime > time.time() - 60


def test_a_build_loads_where_its_folder_cannot_be_written(tmp_path, monkeypatch):
    """A folder prepared read-only (an image's): marking the build used fails, the kernel loads."""
    CpuTokenMask.load(tmp_path)  # built here first

    def refused(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(os, "utime", refused)
    kernel, why = CpuTokenMask.load(tmp_path)
    assert kernel is not None, why
