"""Background threads run torch alone and leave the process default; the stepping thread keeps the
threads it was built with, whatever another thread did to the default meanwhile."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from inference_service.engine.engine_thread import EngineThread
from inference_service.torch_threads import single_threaded

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
