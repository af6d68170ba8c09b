"""HostTier: ready (validated, optimized) adapters in host memory, the popular ones kept, loaded in the
background; each held as a version, the content of one name, since a request keeps the content it
was submitted with."""

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.model.shard import Shard
from inference_service.torch_threads import single_threaded
from shared import adapter_blob
from shared.errors import FailedPrecondition, LoramuxError, Unavailable, brief
from shared.model_config import ModelConfig
from shared.peft_checkpoint import AdapterWeights

log = logging.getLogger(__name__)

LOAD_THREADS = 4  # loads in flight at once: one stalled fetch must not block the rest
# Request counts per adapter are halved every AGING x capacity requests, so eviction follows the
# popularity of the recent past, not of all time (TinyLFU's reset).
AGING = 10


class AdapterLoader(Protocol):
    """Where adapters come from: local PEFT folders (LocalAdapterLoader) or the adapter store
    (StoreAdapterLoader)."""

    def load(self, name: str, digest: str | None = None) -> "ReadyAdapter":
        """Adapter `name` with content `digest` (None: its current content), exactly that or
        an error. Blocking; runs on a loader thread. Raises a LoramuxError naming the cause."""

    def digest_of(self, name: str) -> str | None:
        """The content new requests for `name` get, if known before a load."""

    def __contains__(self, name: str) -> bool:
        """Whether requests may name this adapter."""

    def unregister(self, name: str) -> None:
        """Forget the adapter: new requests for it get NotFound."""


class Version(NamedTuple):
    """One content of an adapter name."""

    name: str
    digest: str


@dataclass(frozen=True)
class ReadyAdapter:
    name: str
    digest: str  # content identity: a re-registered name with new weights gets a new digest
    image: AdapterImage  # as this process's tensor-parallel rank holds it (all of it at one rank)
    blob: Path | None = None  # its wire encoding on disk, named by digest: the other ranks read it

    @classmethod
    def of(
        cls,
        name: str,
        weights: AdapterWeights,
        model: ModelConfig,
        dtype: torch.dtype,
        shard: Shard | None = None,
    ) -> "ReadyAdapter":
        """Digest computed here: the digest of the wire encoding of `weights` (in the serving dtype
        `dtype`), as the adapter store would give it; a loader that already knows the blob's
        digest (the store's) builds ReadyAdapter directly."""
        return cls(name, adapter_blob.digest_of(weights), AdapterImage.of(weights, model, dtype, shard))

    @property
    def version(self) -> Version:
        return Version(self.name, self.digest)


@dataclass(frozen=True)
class HostTierStats:
    hits: int  # gets that found the adapter ready (a request waiting for a slot counts each step)
    misses: int  # gets that started a load
    evictions: int
    size: int  # adapters ready now
    request_hits: int  # requests whose adapter was ready when they arrived
    request_misses: int  # requests that arrived while their adapter was not ready


class HostTier:
    """At most `capacity` unpinned adapters stay (at capacity 0, an adapter stays only until the
    requests waiting for it are admitted); pinned ones never leave. A load runs once per
    version however many requests wait for it; the engine collects finished loads each step.

    Versions: a request is bound to one content of its adapter (`bind`), usually from its
    arrival. A version stays current while the loader gives it for its name; once the name is
    re-registered or removed it is retired: kept, outside the capacity, until the last request
    bound to it ends, then dropped. A retired version no longer here (evicted while current)
    loads again by its digest.

    Waiting requests hold the names they use, from arrival to admission. Eviction drops adapters
    no waiting request holds first; among those, the ones fewest recent requests named (with
    Zipf-like popularity, a one-off adapter must not push out one that every other request
    names), least recently used first among equals. A load starts only while the held adapters
    ready or loading number fewer than `capacity`: a queue naming more adapters than the tier
    keeps loads them as earlier ones finish, instead of evicting adapters that waiting requests
    are about to use (thrashing)."""

    def __init__(
        self,
        capacity: int,
        loader: AdapterLoader,
        pin_memory: bool,
        on_done: Callable[[], None] = lambda: None,
        threads: int = LOAD_THREADS,
    ):
        self.capacity = capacity
        self._loader = loader
        self._pin_memory = pin_memory  # page-locked copies when the device is a GPU
        self._on_done = on_done  # wakes the stepping thread to collect a finished load
        self._ready: OrderedDict[Version, ReadyAdapter] = OrderedDict()  # least recently used first
        self._latest: dict[str, str] = {}  # name -> digest of its last version put here
        self._pinned: set[str] = set()
        self._held: Counter[str] = Counter()  # name -> waiting requests that use it
        self._bound: Counter[Version] = Counter()  # version -> unfinished requests bound to it
        self._uses: Counter[str] = Counter()  # name -> requests that named it, aged (AGING)
        self._arrivals = 0  # requests since the last aging
        self._loading: dict[tuple[str, str | None], Future] = {}  # (name, digest or None: current)
        # A load's tensor work runs on its own thread: the stepping thread's ops keep the CPUs.
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix="adapter-load", initializer=single_threaded
        )
        self.hits = self.misses = self.evictions = 0
        self.request_hits = self.request_misses = 0

    def hold(self, name: str, digest: str | None = None) -> None:
        """A request that uses `name` (content `digest`, None: the current one) arrived: its
        adapter is kept in preference to others until release (the request is admitted or
        ends), and its load starts now if there is room: a prefetch ahead of admission."""
        self._held[name] += 1
        self._count_use(name)
        if self.peek(name, digest) is not None:
            self.request_hits += 1
        else:
            self.request_misses += 1
            self._load_if_room(name, digest)

    def keep(self, name: str, digest: str | None = None) -> None:
        """A running request that uses `name` waits again (preempted): held as on arrival, but
        not counted as a new request."""
        self._held[name] += 1
        if self.peek(name, digest) is None:
            self._load_if_room(name, digest)

    def release(self, name: str) -> None:
        """A request that held `name` was admitted (its adapter is on the device) or ended."""
        self._held[name] -= 1
        if self._held[name] <= 0:
            del self._held[name]
            if len(self._ready) > self.capacity:  # kept past capacity only while a request held it
                self._evict()

    def bind(self, version: Version) -> None:
        """An unfinished request runs on this content, whatever its name serves later."""
        self._bound[version] += 1

    def unbind(self, version: Version) -> None:
        """A request bound to `version` ended; a retired version goes with its last one."""
        self._bound[version] -= 1
        if self._bound[version] <= 0:
            del self._bound[version]
            if not self._current(version):
                self.prune(version.name)

    def get(self, name: str, digest: str | None = None) -> ReadyAdapter | None:
        """The ready version (now most recently used), or None after starting its load if there
        is room for it (otherwise it starts at a later get, once held adapters make room)."""
        ready = self.peek(name, digest)
        if ready is not None:
            self._ready.move_to_end(ready.version)
            self.hits += 1
            return ready
        self._load_if_room(name, digest)
        return None

    def peek(self, name: str, digest: str | None = None) -> ReadyAdapter | None:
        """The ready version if there is one; counts nothing and starts no load."""
        digest = digest or self._loader.digest_of(name) or self._latest.get(name)
        return self._ready.get(Version(name, digest)) if digest else None

    def prepare(self, ready: ReadyAdapter) -> ReadyAdapter:
        """The adapter as the tier keeps it: page-locked when the device is a GPU, so activating
        it is an async copy. A copy of every tensor: call it before put, off the step thread."""
        return replace(ready, image=ready.image.pin_memory()) if self._pin_memory else ready

    def put(self, ready: ReadyAdapter) -> None:
        self._ready[ready.version] = ready
        self._ready.move_to_end(ready.version)
        if self._current(ready.version):
            self._latest[ready.name] = ready.digest
        self._evict()

    def collect(self) -> tuple[list[float], list[tuple[str, str | None, LoramuxError]]]:
        """Install finished loads. Returns the seconds each successful load took and
        (name, digest or None for the current content, error) of the ones that failed."""
        seconds, failed = [], []
        for (name, digest), future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name, digest]
            if future.exception() is not None:
                failed.append((name, digest, _load_error(future.exception(), name)))
            else:
                ready, took = future.result()
                self.put(ready)
                seconds.append(took)
        return seconds, failed

    def prune(self, name: str) -> None:
        """Drop the versions of `name` no request needs: retired (not what the loader gives
        for the name now) and bound to no unfinished request; their loads in flight too (their
        results are dropped)."""
        known = name in self._loader
        for version in [v for v in self._ready if v.name == name and self._stale(v)]:
            del self._ready[version]
        for key in [k for k in self._loading if k[0] == name]:
            if (key[1] is None and not known) or (key[1] is not None and self._stale(Version(*key))):
                del self._loading[key]
        if not known:
            self._latest.pop(name, None)

    def drop(self, version: Version) -> None:
        """The version's weights proved unusable: a later request loads it anew."""
        self._ready.pop(version, None)

    def remove(self, name: str) -> None:
        """Forget a name the loader no longer has: its versions go once no request is bound
        to them, its pin and popularity at once."""
        self._pinned.discard(name)
        self._uses.pop(name, None)
        self.prune(name)

    def pin(self, name: str) -> None:
        """Keep `name` for good; an adapter not held yet starts loading now (a preload). The pin
        counts as a request for it: unpinned later, it is not the first to go."""
        self._pinned.add(name)
        self._count_use(name)
        digest = self._loader.digest_of(name)
        if self.peek(name, digest) is None and (name, digest) not in self._loading:
            self._start_load(name, digest)

    def unpin(self, name: str) -> None:
        if name in self._pinned:
            self._pinned.discard(name)
            self._evict()

    @property
    def loading(self) -> int:
        return len(self._loading)

    def wait_for_loads(self) -> None:
        """Block until every load in flight has finished; the next collect installs them."""
        wait(list(self._loading.values()))

    def held(self) -> list[tuple[str, str | None, bool]]:
        """(name, digest or None while loading, pinned) of every adapter ready or loading, at
        its current version (retired ones serve only the requests bound to them)."""
        ready = [(v.name, v.digest, v.name in self._pinned) for v in self._ready if self._current(v)]
        names = {name for name, _, _ in ready}
        loading = dict.fromkeys(
            n for n, d in self._loading if n not in names and (d is None or self._current(Version(n, d)))
        )
        return ready + [(n, None, n in self._pinned) for n in loading]

    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.hits, self.misses, self.evictions, len(self._ready), self.request_hits, self.request_misses
        )

    def __len__(self) -> int:
        return len(self._ready)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _current(self, version: Version) -> bool:
        """Whether new requests for the name get this content: the loader says so, or knows no
        content for a name it has (the store's catalog view is down)."""
        digest = self._loader.digest_of(version.name)
        return digest == version.digest or (digest is None and version.name in self._loader)

    def _stale(self, version: Version) -> bool:
        return version not in self._bound and not self._current(version)

    def _load_if_room(self, name: str, digest: str | None) -> None:
        """Start loading the version unless it is loading, or the held adapters ready and the
        loads in flight already fill the tier (pinned adapters and retired versions, which
        requests are bound to, come on top of it and never count)."""
        digest = digest or self._loader.digest_of(name)
        if (name, digest) in self._loading:
            return
        retired = digest is not None and not self._current(Version(name, digest))
        held_ready = sum(
            1 for v in self._ready if v.name in self._held and v.name not in self._pinned and self._current(v)
        )
        if name in self._pinned or retired or held_ready + len(self._loading) < max(self.capacity, 1):
            self.misses += 1
            self._start_load(name, digest)

    def _count_use(self, name: str) -> None:
        self._uses[name] += 1
        self._arrivals += 1
        if self._arrivals >= AGING * max(self.capacity, 1):
            self._arrivals = 0
            self._uses = Counter({n: uses // 2 for n, uses in self._uses.items() if uses > 1})

    def _start_load(self, name: str, digest: str | None) -> None:
        future = self._pool.submit(self._load, name, digest)
        self._loading[name, digest] = future
        future.add_done_callback(lambda _: self._on_done())

    def _load(self, name: str, digest: str | None) -> tuple[ReadyAdapter, float]:
        start = time.perf_counter()
        ready = self.prepare(self._loader.load(name, digest))
        return ready, time.perf_counter() - start

    def _evict(self) -> None:
        # Evicting only drops the host copy: requests already holding a device slot keep it. An
        # adapter a waiting request holds never goes (it would be loaded again at once, and with
        # capacity 0 never reach the device). Loads start only while the held adapters fit
        # (_load_if_room), so that keeps more than `capacity` only at capacity 0, by one. Among
        # the others, the least used go first, the least recently used first among equals.
        # Retired versions stay for the requests bound to them, and only for them.
        for version in [v for v in self._ready if self._stale(v)]:
            del self._ready[version]
        unpinned = [v for v in self._ready if v.name not in self._pinned and self._current(v)]
        evictable = [v for v in unpinned if v.name not in self._held]
        evictable.sort(key=lambda v: self._uses[v.name])  # stable: LRU order among equals
        for version in evictable[: max(0, len(unpinned) - self.capacity)]:
            del self._ready[version]
            self.evictions += 1


def _load_error(error: Exception, name: str) -> LoramuxError:
    """A failed load as the status its requests end with, naming the adapter."""
    if isinstance(error, LoramuxError):
        return error
    log.error("loading adapter %r failed", name, exc_info=error)
    if isinstance(error, OSError):  # this worker's disk (a full cache), not the adapter
        return Unavailable(
            f"adapter {name!r}: this worker cannot read or write its adapter cache ({brief(error)})"
        )
    return FailedPrecondition(f"adapter {name!r} could not be loaded: {brief(error)}")
