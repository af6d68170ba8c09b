"""DeltaQueue: deltas put from the stepping thread reach the coroutine on its loop, in order,
each exactly once, every pending one in one take; a put never waits and never fails."""

import asyncio
import threading

from inference_service.engine.delta_queue import DeltaQueue
from inference_service.engine.request import Delta


def _delta(i: int) -> Delta:
    return Delta("r", [i], str(i))


def test_a_take_gets_every_delta_put_meanwhile_in_order_and_waits_when_there_is_none():
    async def scenario():
        queue = DeltaQueue(asyncio.get_running_loop())
        for i in range(3):
            queue.put(_delta(i))  # the consumer is not waiting: nothing to wake
        first = await queue.take()
        waiting = asyncio.ensure_future(queue.take())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        threading.Thread(target=lambda: [queue.put(_delta(i)) for i in range(3, 6)]).start()
        taken = [first, await waiting]
        while sum(map(len, taken)) < 6:
            taken.append(await queue.take())
        return taken

    taken = asyncio.run(scenario())
    assert [d.token_ids[0] for d in taken[0]] == [0, 1, 2]
    assert [d.token_ids[0] for batch in taken for d in batch] == list(range(6))


def test_puts_from_a_thread_racing_the_consumer_lose_nothing():
    async def scenario():
        queue = DeltaQueue(asyncio.get_running_loop())
        producer = threading.Thread(target=lambda: [queue.put(_delta(i)) for i in range(2000)])
        producer.start()
        seen = []
        while len(seen) < 2000:
            seen += [d.token_ids[0] for d in await queue.take()]
        producer.join()
        return seen

    assert asyncio.run(scenario()) == list(range(2000))


def test_a_put_after_the_consumer_went_away_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    queue = DeltaQueue(loop)
    waiting = loop.create_task(queue.take())
    loop.run_until_complete(asyncio.sleep(0))  # the consumer waits
    waiting.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    queue.put(_delta(0))  # its loop is closed: nobody listens, and the stepping thread goes on
