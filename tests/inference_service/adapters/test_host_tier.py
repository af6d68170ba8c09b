"""HostTier with a real thread pool: per-request hit counts, loads bounded by what waiting requests
hold, and eviction that keeps the adapters waiting requests name, then the popular ones."""

import threading
import time

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.host_tier import AGING, HostTier, ReadyAdapter

NO_IMAGE = AdapterImage((), ())  # the tier never looks inside


class GatedLoader:
    """Loads any name once its gate opens; records the order loads started in."""

    def __init__(self):
        self.started: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
        self.started.append(name)
        self.gate.wait(10)
        return ReadyAdapter(name, f"digest-{name}", NO_IMAGE)

    def digest_of(self, name: str) -> str | None:
        return f"digest-{name}"

    def __contains__(self, name: str) -> bool:
        return True

    def unregister(self, name: str) -> None:
        pass


def _settle(tier: HostTier) -> None:
    """Wait until no load is in flight and install what landed."""
    deadline = time.monotonic() + 10
    while tier.loading and time.monotonic() < deadline:
        tier.collect()
        time.sleep(0.005)
    assert not tier.loading


def _wait_for(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def _load(tier: HostTier, *names: str) -> None:
    for name in names:
        tier.get(name)
        _settle(tier)


def test_each_request_counts_one_hit_or_miss_however_often_it_is_checked():
    tier = HostTier(4, GatedLoader(), pin_memory=False)
    tier.hold("a")  # arrives cold: a miss, and its load starts at once
    _settle(tier)
    tier.hold("a")  # arrives warm
    for _ in range(5):
        tier.get("a")  # a request waiting for a slot is checked at every step

    stats = tier.stats()
    assert (stats.request_hits, stats.request_misses) == (1, 1)
    assert (stats.hits, stats.misses) == (5, 1)
    tier.close()


def test_eviction_keeps_an_adapter_a_waiting_request_names_over_more_recent_ones():
    tier = HostTier(2, GatedLoader(), pin_memory=False)
    _load(tier, "b", "a")  # b is the least recently used
    tier.hold("b")

    _load(tier, "c")

    assert {name for name, _, _ in tier.held()} == {"b", "c"}
    tier.release("b")
    tier.hold("c")
    tier.release("c")  # as many requests named c as b
    _request(tier, "d")  # nobody waits for b any more, and c is as popular: the least recent goes
    assert {name for name, _, _ in tier.held()} == {"c", "d"}
    tier.close()


def _request(tier: HostTier, name: str) -> None:
    """A request for `name` arrives, waits for its adapter and is admitted."""
    tier.hold(name)
    _settle(tier)
    tier.release(name)


def _kept(tier: HostTier) -> set[str]:
    return {name for name, _, _ in tier.held()}


def test_eviction_keeps_the_adapter_most_requests_named_over_more_recent_ones():
    tier = HostTier(2, GatedLoader(), pin_memory=False)
    for name in ("popular", "popular", "popular", "once"):
        _request(tier, name)

    _request(tier, "new")  # popular is the least recently used, and named most

    assert _kept(tier) == {"popular", "new"}
    tier.close()


def test_popularity_ages_so_an_adapter_no_longer_named_is_evicted_in_time():
    tier = HostTier(2, GatedLoader(), pin_memory=False)
    period = AGING * tier.capacity  # requests between two halvings of every count
    for _ in range(3):
        _request(tier, "popular")
    for i in range(period - 4):
        _request(tier, f"once-{i}")
    assert "popular" in _kept(tier)  # 3 requests against the one-offs' 1, before any aging

    for i in range(period):
        _request(tier, f"later-{i}")
    assert "popular" not in _kept(tier)  # aged to 1 like the one-offs, and the least recent
    tier.close()


def test_a_queue_naming_more_adapters_than_the_tier_holds_loads_them_as_room_appears():
    loader = GatedLoader()
    tier = HostTier(2, loader, pin_memory=False)
    loader.gate.clear()
    for name in ("x", "y", "z"):
        tier.hold(name)

    _wait_for(lambda: len(loader.started) == 2)  # on the loader threads
    assert sorted(loader.started) == ["x", "y"]  # z would have to evict an adapter a request waits for
    assert tier.get("z") is None and tier.loading == 2
    loader.gate.set()
    _settle(tier)
    tier.release("x")  # x's request was admitted: its adapter is on the device now
    assert tier.get("z") is None  # starts z's load
    _settle(tier)

    assert sorted(loader.started) == ["x", "y", "z"]
    assert tier.peek("y") is not None and tier.peek("z") is not None  # y still waits: kept
    tier.close()


def test_at_capacity_0_an_adapter_stays_until_the_requests_waiting_for_it_are_admitted():
    loader = GatedLoader()
    tier = HostTier(0, loader, pin_memory=False)
    tier.hold("a")
    tier.hold("a")
    _settle(tier)
    assert tier.get("a") is not None  # landed and kept: evicted on arrival, it would load forever
    tier.release("a")
    assert tier.peek("a") is not None  # the second request still waits
    tier.release("a")

    assert tier.peek("a") is None and len(tier) == 0
    assert loader.started == ["a"]
    tier.close()


def test_wait_for_loads_returns_once_every_load_in_flight_has_finished():
    loader = GatedLoader()
    tier = HostTier(4, loader, pin_memory=False)
    loader.gate.clear()
    tier.get("a")
    tier.get("b")
    opener = threading.Timer(0.2, loader.gate.set)
    opener.start()
    tier.wait_for_loads()
    assert loader.gate.is_set()  # it waited for the gated loads
    tier.collect()
    assert (tier.loading, len(tier)) == (0, 2)  # both landed, installed by the next collect
    tier.close()


def test_an_unpinned_preload_stays_until_adapters_used_less_recently_go():
    tier = HostTier(2, GatedLoader(), pin_memory=False)
    _request(tier, "a")
    _request(tier, "b")
    tier.pin("preloaded")  # loads it now, ahead of any request
    _settle(tier)

    tier.unpin("preloaded")  # the tier holds 3 of 2 now

    assert _kept(tier) == {"b", "preloaded"}
    tier.close()


def test_loads_run_their_torch_ops_on_their_own_thread():
    """Only the stepping thread spreads torch ops over threads (inference_service.torch_threads)."""
    threads = []

    class CountingLoader(GatedLoader):
        def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
            torch.ones(1 << 20).mul_(2)
            threads.append(torch.get_num_threads())
            return super().load(name, digest)

    tier = HostTier(4, CountingLoader(), pin_memory=False)
    _load(tier, "a", "b")
    assert threads == [1, 1]
