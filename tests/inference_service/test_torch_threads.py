"""Background threads run torch alone and leave the process default; the stepping thread keeps the
threads it was built with, whatever another thread did to the default meanwhile; building an
engine leaves its caller without a team of threads."""

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from inference_service.engine.engine_thread import EngineThread
from inference_service.torch_threads import single_threaded
from tests.adapter_store.conftest import REPO
from tests.conftest import build_peft_adapter, build_tiny_model

DEFAULT = torch.get_num_threads()
pytestmark = pytest.mark.skipif(DEFAULT < 2, reason="torch runs one thread here: nothing to tell apart")


def _in_new_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def _threads_after_an_op() -> int:
    torch.ones(1 << 20).mul_(2)  # large enough to run in parallel
    return torch.get_num_threads()


def test_a_single_threaded_thread_runs_alone_and_threads_after_it_get_the_default():
    with ThreadPoolExecutor(1, initializer=single_threaded) as pool:
        assert pool.submit(_threads_after_an_op).result() == 1
        assert _in_new_thread(_threads_after_an_op) == DEFAULT
    assert torch.get_num_threads() == DEFAULT


def test_the_engine_thread_steps_with_its_builders_threads_though_the_default_dropped_to_one():
    seen, stepped = [], threading.Event()

    def step():
        seen.append(_threads_after_an_op())
        stepped.set()

    engine = EngineThread(step, lambda: not stepped.is_set(), threading.Event(), step_timeout_s=60)
    _in_new_thread(lambda: torch.set_num_threads(1))  # as a thread in single_threaded may, for a moment
    try:
        engine.start()
        assert stepped.wait(30)
    finally:
        _in_new_thread(lambda: torch.set_num_threads(DEFAULT))
        engine.stop()
    assert seen == [DEFAULT]


# The process's OS threads, where an OpenMP team's threads show (threading sees none of them).
BUILD_AN_ENGINE = """
import os, sys, time
import torch
from inference_service.engine import Engine, EngineConfig

def os_threads():
    return len(os.listdir("/proc/self/task"))

start = os_threads()
engine = Engine(EngineConfig(model=sys.argv[1], max_lora_rank=64))
engine.add_adapter("wide", sys.argv[2])
deadline = time.monotonic() + 10
while os_threads() > start and time.monotonic() < deadline:
    time.sleep(0.05)  # a passing thread's team exits just after it
built = os_threads()
torch.ones(1 << 22).mul_(2)  # runs in parallel: the caller's team, if it had none, starts now
print(start, built, os_threads())
"""


@pytest.fixture(scope="module")
def wide_model_and_adapter(tmp_path_factory) -> list[str]:
    """A model and a rank-64 adapter wide enough that reading them runs torch ops in parallel."""
    root = tmp_path_factory.mktemp("wide")
    model = build_tiny_model(root / "model", hidden_size=512, intermediate_size=1024)
    lora = dict(r=64, lora_alpha=64, target_modules="all-linear")
    adapter = build_peft_adapter(model, root / "adapter", seed=1, **lora)
    return [str(model), str(adapter)]


def test_building_an_engine_and_adding_an_adapter_leave_the_caller_without_a_team(wide_model_and_adapter):
    """A team left in the caller's thread would outlive the build and slow every step of the
    engine thread's (torch_threads)."""
    run = subprocess.run(
        [sys.executable, "-c", BUILD_AN_ENGINE, *wide_model_and_adapter],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    start, built, after_an_op = map(int, run.stdout.split())
    assert built == start
    assert after_an_op == start + DEFAULT - 1  # the caller's own team: one thread besides itself
