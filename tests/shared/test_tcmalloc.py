"""tcmalloc under the CPU's workers: launchers put it first in LD_PRELOAD where it is installed,
entry points run themselves again on it, and a process can tell whether it allocates with it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import local_stack
from inference_service.demo import demo
from shared import tcmalloc
from tests.allocators import on_each_allocator

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
    assert on_each_allocator(probe) == ("False", "True")


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_an_entry_point_runs_its_own_command_again_on_tcmalloc_once(tmp_path):
    """As `python -m bench.suite` and `bench.peers` begin: the same command line, now on tcmalloc.
    A tcmalloc already named in LD_PRELOAD that the loader could not load is not tried again."""
    probe = "import sys; from shared import tcmalloc; tcmalloc.run_again_preloaded(); "
    probe += "print(tcmalloc.loaded(), sys.argv[1:])"
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    missing = {**env, "LD_PRELOAD": str(tmp_path / "libtcmalloc_minimal.so.4")}
    for environment, expected in ((env, "True"), (missing, "False")):
        command = [sys.executable, "-c", probe, "--only", "moe"]
        reply = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=60)
        assert reply.stdout.strip() == f"{expected} ['--only', 'moe']", reply.stderr


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
@pytest.mark.parametrize("module", ["bench.suite", "bench.peers"])
def test_the_benchmarks_entry_points_run_on_tcmalloc(module):
    """`python -m bench.suite` (make bench) and `bench.peers` (make bench-peers), started without
    it: what runs their arguments (here --help) allocates with tcmalloc. The suite's plots stand
    in for themselves: matplotlib comes with the bench extra, which `make test` does not install."""
    probe = (
        "import atexit, runpy, sys, types; from shared import tcmalloc; "
        "plots = sys.modules['bench.plots'] = types.ModuleType('bench.plots'); "
        "plots.__getattr__ = lambda name: None; "
        "atexit.register(lambda: print('on tcmalloc:', tcmalloc.loaded())); "
        f"sys.argv = [{module!r}, '--help']; runpy.run_module({module!r}, run_name='__main__')"
    )
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    reply = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert reply.returncode == 0 and "usage:" in reply.stdout, reply.stderr
    assert reply.stdout.strip().endswith("on tcmalloc: True")


@pytest.mark.skipif(tcmalloc.library() is None, reason="tcmalloc is not installed here")
def test_the_benchmarks_services_allocate_with_tcmalloc(tmp_path, monkeypatch):
    """bench.local_stack starts the stores and workers the serving benchmarks measure as `make run`
    starts them, whatever the benchmark's own process runs on."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    store, _ = local_stack.start("adapter_store", "--data-dir", str(tmp_path))
    try:
        assert tcmalloc.loaded(Path(f"/proc/{store.pid}/maps"))
    finally:
        store.terminate()
        store.wait()


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
