"""DeepStackThreads: its threads start at the first submit, with the stack asked for (as the C
library reports a thread's own stack); the process's default for other threads stays as it was;
work and its errors come back through Futures; a shutdown cancels what has not started and
refuses more."""

import ctypes
import threading
from concurrent.futures import CancelledError

import pytest

from inference_service.engine.deep_stack_threads import DeepStackThreads

STACK = 48 << 20


def own_stack_bytes() -> int:
    """The calling thread's stack size, from glibc (pthread_getattr_np)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # a pthread_attr_t (56 bytes on x86-64 glibc)
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    size = ctypes.c_size_t()
    assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    libc.pthread_attr_destroy(attr)
    return size.value


@pytest.fixture
def threads():
    pool = DeepStackThreads(2, STACK, "test")
    yield pool
    pool.shutdown()


def test_threads_start_at_the_first_submit():
    before = threading.active_count()
    pool = DeepStackThreads(2, STACK, "test")
    assert threading.active_count() == before
    pool.submit(pow, 2, 3).result(timeout=10)
    assert threading.active_count() == before + 2
    pool.shutdown()


def test_threads_have_the_stack_asked_for(threads):
    assert threads.submit(own_stack_bytes).result(timeout=10) == STACK
    assert own_stack_bytes() < STACK


def test_the_default_for_other_threads_is_left_as_it_was():
    pool = DeepStackThreads(1, STACK, "test")
    pool.submit(pow, 2, 3).result(timeout=10)  # its threads started
    pool.shutdown()
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(own_stack_bytes()))
    thread.start()
    thread.join()
    assert elsewhere[0] < STACK


def test_results_and_errors_come_back(threads):
    assert threads.submit(pow, 2, 10).result(timeout=10) == 1024
    with pytest.raises(ZeroDivisionError):
        threads.submit(divmod, 1, 0).result(timeout=10)
    assert threads.submit(sum, [1, 2]).result(timeout=10) == 3  # the thread that raised goes on


def test_shutdown_cancels_what_has_not_started_and_refuses_more():
    pool = DeepStackThreads(1, STACK, "test")
    started, release = threading.Event(), threading.Event()
    running = pool.submit(lambda: started.set() or release.wait(10))
    assert started.wait(10)
    waiting = pool.submit(pow, 2, 3)
    pool.shutdown()
    release.set()
    assert running.result(timeout=10) is True
    with pytest.raises(CancelledError):
        waiting.result(timeout=10)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(pow, 2, 3)
