"""DeepStackThreads: a fixed pool of threads with stacks of a given size, for work that recurses
as deep as its input nests (the grammar engine compiling a constraint).

The standard library's pool takes no stack size, and a thread's stack is fixed when it starts:
these threads all start at the first submit (a process that never submits has none), under
`threading.stack_size`, which is set back at once. A caller submits work as to concurrent.futures'
pool and gets the same Future.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class DeepStackThreads:
    def __init__(self, threads: int, stack_bytes: int, name: str):
        self._name, self._stack_bytes = name, stack_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (Future, fn, args); None stops a thread
        self._lock = threading.Lock()  # the threads start once; no job is queued behind the stops
        self._started = self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} threads are shut down")
            if not self._started:
                self._start()
            self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancels the work not started; what runs finishes, and its thread then ends."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    future, _, _ = self._jobs.get_nowait()
                except queue.Empty:
                    break
                future.cancel()
            for _ in self._threads:
                self._jobs.put(None)

    def _start(self) -> None:
        self._started = True
        previous = threading.stack_size(self._stack_bytes)
        try:
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the submitter's to see, as with a pool's Future
                future.set_exception(e)
