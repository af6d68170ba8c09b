"""tcmalloc under the CPU's workers: launchers put it first in LD_PRELOAD where it is installed,
and a process can tell whether it allocates with it."""

import os
import subprocess
import sys

import pytest

from inference_service.demo import demo
from shared import tcmalloc

LIBRARY = "libtcmalloc_minimal.so.4"


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(tcmalloc, "library", lambda: LIBRARY)


def test_preloading_puts_tcmalloc_first_and_keeps_what_was_there(installed):
    assert tcmalloc.preloading({"PATH": "/bin"}) == {"PATH": "/bin", "LD_PRELOAD": LIBRARY}
    assert tcmalloc.preloading({"LD_PRELOAD": "libx.so"})["LD_PRELOAD"] == f"{LIBRARY}:libx.so"
    already = {"LD_PRELOAD": "/opt/lib/libtcmalloc.so"}
    assert tcmalloc.preloading(already) == already


def test_preloading_without_tcmalloc_installed_changes_nothing(monkeypatch):
    monkeypatch.setattr(tcmalloc, "library", lambda: None)
    assert tcmalloc.preloading({"LD_PRELOAD": "libx.so"}) == {"LD_PRELOAD": "libx.so"}
    assert "LD_PRELOAD" not in tcmalloc.preloading({})


def test_loaded_reads_the_libraries_mapped(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not tcmalloc.loaded(maps)
    maps.write_text(maps.read_text() + f"7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/{LIBRARY}\n")
    assert tcmalloc.loaded(maps)


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_a_process_started_preloading_it_allocates_with_tcmalloc():
    """As `make run` starts its services (demo._spawn), and as the process itself sees it."""
    probe = "from shared import tcmalloc; print(tcmalloc.loaded())"
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    for environment, expected in ((env, "False"), (tcmalloc.preloading(env), "True")):
        reply = subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True)
        assert reply.stdout.strip() == expected, reply.stderr


def test_a_cpu_worker_on_glibcs_malloc_says_so_and_make_runs_does_not(tmp_path, capfd, monkeypatch):
    """The worker's first line names what to install; `make run` starts its worker preloading
    tcmalloc (demo._spawn). A missing model then stops the worker at once."""
    args = ["--listen", "127.0.0.1:0", "--model", str(tmp_path)]
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    command = [sys.executable, "-m", "inference_service", *args]
    worker = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert worker.returncode != 0 and "has no config.json" in worker.stderr, worker.stderr
    assert "libtcmalloc-minimal4" in worker.stderr
    if tcmalloc.library():
        capfd.readouterr()
        assert demo._spawn("inference_service", *args).wait(timeout=120) != 0
        err = capfd.readouterr().err
        assert "has no config.json" in err and "libtcmalloc-minimal4" not in err, err
