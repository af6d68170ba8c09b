"""Fetch limits from the command line, refused when meaningless; the idle watchdog cancels a call
only when it goes silent."""

import threading
import time

import pytest

from inference_service.adapters.blob_fetch import FetchLimits, IdleWatchdog
from inference_service.server.main import parse_config
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from tests.model_shapes import QWEN3_30B_A3B_CONFIG


def test_flags_set_the_fetch_limits():
    config = parse_config(["--model", "m", "--max-adapter-bytes", "1000", "--fetch-idle-timeout", "2.5"])
    assert config.fetch == FetchLimits(max_bytes=1000, idle_timeout_s=2.5, timeout_s=120.0)
    assert parse_config(["--model", "m"]).fetch == FetchLimits(0, 10.0, 120.0)


def test_the_default_blob_limit_takes_any_adapter_of_max_lora_rank_on_the_model():
    """On Qwen3-30B-A3B a rank-16 adapter on every module is 1.7 GB in bfloat16, over the 1 GiB
    the worker once took; the default is sized for rank max_lora_rank in float32, the embedding
    and head with PEFT's base copies too."""
    model = ModelConfig.from_dict(QWEN3_30B_A3B_CONFIG)
    assert FetchLimits(0).for_model(model, 16).max_bytes == 5_900_707_328
    assert FetchLimits(0).for_model(model, 64).max_bytes == 16_105_989_632
    assert FetchLimits(5000).for_model(model, 16).max_bytes == 5000


@pytest.mark.parametrize(
    "limits, word",
    [((-1, 1, 1), "max_adapter_bytes"), ((1, 0, 1), "fetch_idle_timeout"), ((1, 1, -1), "fetch_timeout")],
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
