"""Fetch limits from the command line, refused when meaningless; the idle watchdog cancels a call
only when it goes silent."""

import threading
import time

import pytest

from inference_service.adapters.blob_fetch import FetchLimits, IdleWatchdog
from inference_service.server.main import parse_config
from shared.errors import InvalidArgument


def test_flags_set_the_fetch_limits():
    config = parse_config(["--model", "m", "--max-adapter-bytes", "1000", "--fetch-idle-timeout", "2.5"])
    assert config.fetch == FetchLimits(max_bytes=1000, idle_timeout_s=2.5, timeout_s=120.0)
    assert parse_config(["--model", "m"]).fetch == FetchLimits(1 << 30, 10.0, 120.0)


@pytest.mark.parametrize(
    "limits, word",
    [((0, 1, 1), "max_adapter_bytes"), ((1, 0, 1), "fetch_idle_timeout"), ((1, 1, -1), "fetch_timeout")],
)
def test_meaningless_limits_are_refused(limits, word):
    with pytest.raises(InvalidArgument, match=word):
        FetchLimits(*limits)


class Call:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_the_watchdog_cancels_only_a_silent_call():
    call = Call()
    watchdog = IdleWatchdog(call, 1.0)
    for _ in range(15):  # 1.5 s of messages every 0.1 s: never idle for 1 s
        time.sleep(0.1)
        watchdog.feed()
    assert not call.cancelled.is_set() and not watchdog.fired
    assert call.cancelled.wait(5) and watchdog.fired


def test_a_stopped_watchdog_never_fires():
    call = Call()
    IdleWatchdog(call, 1.0).stop()  # a second of margin: a loaded machine may pause this thread
    assert not call.cancelled.wait(1.3)
