"""A storm of cancelled Generate calls logs a few lines that still count every cancel."""

import asyncio
import contextlib
import logging

from inference_service.server.request_log import CancelLog, request_log

WINDOW_S = 0.2


def cancel_burst(cancels: CancelLog, first: int, count: int) -> None:
    """`count` calls cancelled by their callers, one after another."""
    for i in range(first, first + count):
        with contextlib.suppress(asyncio.CancelledError), request_log(f"w{i}", f"r{i}", "a", cancels):
            raise asyncio.CancelledError


def test_a_burst_of_cancels_logs_the_first_then_the_count_of_each_window(caplog):
    async def storm():
        cancels = CancelLog(WINDOW_S)
        cancel_burst(cancels, 0, 1000)
        await asyncio.sleep(1.5 * WINDOW_S)  # the first window ends; the storm goes on in the next
        cancel_burst(cancels, 1000, 500)
        await asyncio.sleep(2.5 * WINDOW_S)  # that window ends, then a quiet one
        cancel_burst(cancels, 1500, 1)

    with caplog.at_level(logging.INFO, logger="inference_service.server.request_log"):
        asyncio.run(storm())

    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert lines[0].startswith("request w0 (request_id 'r0', adapter 'a') was cancelled by its caller")
    assert lines[1:3] == [
        f"{count} more Generate calls were cancelled by their callers in the last {WINDOW_S:g} s"
        for count in (999, 500)
    ]
    assert lines[3].startswith("request w1500 (request_id 'r1500', adapter 'a') was cancelled")
    assert len(lines) == 4
