"""EngineThread: runs an engine's steps in a background thread, and gives up on the engine when
a step raises, or runs past its time limit (a hung device, a deadlock), so that the process can
exit for its supervisor to restart it. Before it starts, it steps for Engine.generate (drive)."""

import logging
import threading
import time
from collections.abc import Callable

import torch

from inference_service.torch_threads import in_passing_thread, parallel
from shared.errors import Unavailable, brief

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(
        self,
        step: Callable[[], None],
        has_work: Callable[[], bool],
        wakeup: threading.Event,
        step_timeout_s: float,
        torch_threads: int | None = None,
    ):
        self._step, self._has_work, self._wakeup = step, has_work, wakeup
        self._step_timeout_s = step_timeout_s
        # by default the builder's: steps run as they would there
        self._torch_threads = torch_threads or torch.get_num_threads()
        self._shares_cpus = torch_threads is not None  # steps of its own thread count, wherever they run
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_started: float | None = None  # monotonic time the step in progress began
        self._lock = threading.Lock()
        self._fatal: Unavailable | None = None  # set once the engine died or was given up on
        self._on_fatal: list[Callable[[Unavailable], None]] = []

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def drive(self, done: Callable[[], bool]) -> None:
        """Steps until done(), this thread not started. Given a thread count of its own (a rank
        sharing the CPUs with other ranks), it steps over that many threads, as its own thread
        does, in a thread that ends with the call; the caller's own count stays as it was.
        Stepped over every CPU beside the other ranks' threads, each collective waited on
        threads spinning where the CPUs were taken (the default model on 3 ranks of 2 CPUs took
        6.1 s for 20 tokens, and takes 3.9 s)."""
        if self._shares_cpus:
            in_passing_thread(self._steps_over, done)
        else:
            self._steps(done)

    def _steps_over(self, done: Callable[[], bool]) -> None:
        parallel(self._torch_threads)
        self._steps(done)

    def _steps(self, done: Callable[[], bool]) -> None:
        while not done():
            self._step()

    def on_fatal(self, callback: Callable[[Unavailable], None]) -> None:
        """`callback(error)` runs once if the engine dies (at once if it already has); callbacks
        run in the order they were added."""
        with self._lock:
            self._on_fatal.append(callback)
            dead = self._fatal
        if dead is not None:
            callback(dead)

    def _run(self) -> None:
        parallel(self._torch_threads)
        try:
            while not self._stopping and self._fatal is None:
                if self._has_work():
                    self._timed_step()
                else:
                    self._wakeup.wait()
                    self._wakeup.clear()  # has_work is checked again before sleeping
        except Exception as e:
            log.exception("the engine failed; ending every request with UNAVAILABLE")
            self._die(Unavailable(f"the worker's engine failed ({brief(e)}); retry on another worker"))

    def _timed_step(self) -> None:
        self._step_started = time.monotonic()
        try:
            self._step()
        finally:
            self._step_started = None

    def _watch(self) -> None:
        limit = self._step_timeout_s
        while not self._stopping and self._fatal is None:
            time.sleep(min(1.0, limit / 4))
            started = self._step_started
            if started is not None and time.monotonic() - started > limit:
                log.error("an engine step has run for over %g s; giving up on the engine", limit)
                self._die(Unavailable(f"the worker's engine failed (a step ran past {limit:g} s); retry"))

    def _die(self, error: Unavailable) -> None:
        with self._lock:
            if self._fatal is not None:
                return
            self._fatal = error
            callbacks = list(self._on_fatal)  # a callback added from now on runs at once instead
        for callback in callbacks:
            callback(error)
