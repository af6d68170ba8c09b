"""AdapterMemory: which adapters hold which pages of the unified adapter memory, who uses them,
and which go when a new one needs room.

The memory is one pool of `units` equal units (the same unit offsets in every layer). An adapter
takes, per LoRA target t (the model's lora_targets order), need[t] pages of PAGE_RANK rank rows;
a page of target t is a run of page_units[t] contiguous units. A page of an MoE layer's expert
target holds those rank rows for every expert, one block after another: experts times the units.
Pages of one adapter need not be adjacent, so adapters of any rank share the memory without
fragmenting it whole-adapter-wise (S-LoRA). A model's memory has one more target after its LoRA
targets: the vocabulary side (model/vocab_layout.py), whose parts take one run of need[t]
adjacent units (a target of `runs`: its pages are those units, one each).
"""

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inference_service.engine.config import EngineConfig
from inference_service.model.adapter_units import page_units, unit_elements
from kernels.lora_batch import PAGE_RANK
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig

Pages = tuple[tuple[int, ...], ...]  # [targets][pages]: the first unit of each page, in rank order


@dataclass(frozen=True)
class SlotStats:
    activations: int  # adapters copied into memory
    evictions: int  # adapters dropped from memory to make room for another
    active: int  # adapters in use by running requests
    bytes_used: int  # device bytes holding resident adapters, busy or idle
    bytes_total: int


def adapter_bytes(model: ModelConfig, need: tuple[int, ...], dtype: torch.dtype) -> int:
    """Device bytes, over all layers, of an adapter needing `need` pages per target."""
    return _units(need, page_units(model)) * unit_bytes(model, dtype)


def slot_memory(model: ModelConfig, loras: int, rank: int, dtype: torch.dtype) -> int:
    """Bytes of `loras` adapters of rank `rank` on every target: what max_loras slots of
    max_lora_rank held before unified memory, the default --adapter-memory. A fully sharded
    column target holds ceil(rank / N) of the rank rows on each of its N ranks."""
    shapes = model.linear_shapes().values()
    need = tuple(math.ceil(math.ceil(rank / s.gathered) / PAGE_RANK) for s in shapes)
    return loras * adapter_bytes(model, (*need, 0), dtype)


def memory_units(model: ModelConfig, memory_bytes: int, dtype: torch.dtype) -> int:
    """Whole units in `memory_bytes` of device memory; one unit spans every layer (all layers
    share the offsets), so it takes num_layers * unit_elements elements."""
    return memory_bytes // unit_bytes(model, dtype)


def adapter_memory_units(config: EngineConfig, model: ModelConfig) -> int:
    """Units of the worker's adapter memory: --adapter-memory bytes, or max_loras adapters of
    max_lora_rank on every target. Memory that cannot hold one such adapter is refused: an
    adapter the worker accepts (rank <= max_lora_rank) must always fit."""
    one = slot_memory(model, 1, config.max_lora_rank, config.torch_dtype)
    memory = config.adapter_memory or config.max_loras * one
    if 0 < memory < one:
        raise InvalidArgument(
            f"adapter_memory {memory} bytes cannot hold one adapter of max_lora_rank {config.max_lora_rank} "
            f"on every module ({one} bytes on this model in {config.dtype}); raise it or lower max_lora_rank"
        )
    return memory_units(model, memory, config.torch_dtype)


def check_device_room(config: EngineConfig, model: ModelConfig, weights: int, kv: int, budget: int) -> None:
    """Refuse to start when the base weights (`weights` bytes), the adapter memory and the KV
    cache of one max_model_len request (`kv` bytes) exceed the `budget` bytes the device gives
    them: allocating them would end in an out-of-memory error that names none of them. An MoE
    model's adapters are large (an expert target's page holds every expert's rows: a rank-64
    adapter on every module of Qwen3-30B-A3B is 6.8 GB in bfloat16), so the default of
    max_loras adapters of max_lora_rank may not fit beside its weights."""
    memory = adapter_memory_units(config, model) * unit_bytes(model, config.torch_dtype)
    if weights + memory + kv <= budget:
        return
    one = slot_memory(model, 1, config.max_lora_rank, config.torch_dtype)
    sized = (
        f"--adapter-memory {config.adapter_memory:,}"
        if config.adapter_memory
        else f"--max-loras {config.max_loras} adapters of --max-lora-rank {config.max_lora_rank}"
    )
    raise InvalidArgument(
        f"the base weights ({weights:,} bytes), the adapter memory ({memory:,} bytes: {sized}) and the "
        f"KV cache of one max_model_len request ({kv:,} bytes) need {weights + memory + kv:,} bytes, more "
        f"than the {budget:,} bytes --gpu-memory-utilization {config.gpu_memory_utilization:g} leaves on "
        f"this GPU; beside the rest there is room for {max(0, budget - weights - kv) // one} adapters of "
        f"max_lora_rank {config.max_lora_rank} on every module ({one:,} bytes each in {config.dtype}): "
        "lower --max-loras or --max-lora-rank, or set --adapter-memory"
    )


def unit_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    """Device bytes of one unit over all layers."""
    return model.num_layers * unit_elements(model) * dtype.itemsize


def _units(need: tuple[int, ...], page_units: tuple[int, ...]) -> int:
    """Units an adapter needing `need` pages per target takes."""
    return sum(n * size for n, size in zip(need, page_units, strict=True))


class _FreeRuns:
    """Free units as sorted, disjoint, non-adjacent runs [start, start + length)."""

    def __init__(self, runs: list[tuple[int, int]]):
        self._runs = runs

    def copy(self) -> "_FreeRuns":
        return _FreeRuns(list(self._runs))

    @property
    def total(self) -> int:
        return sum(length for _, length in self._runs)

    def take(self, length: int) -> int | None:
        """The start of `length` units cut from the first run long enough, or None."""
        for i, (start, run) in enumerate(self._runs):
            if run >= length:
                self._runs[i : i + 1] = [(start + length, run - length)] if run > length else []
                return start
        return None

    def give(self, start: int, length: int) -> None:
        """Free [start, start + length), merging it with the runs it touches."""
        i = bisect.bisect(self._runs, (start, length))
        if i > 0 and self._runs[i - 1][0] + self._runs[i - 1][1] == start:
            i -= 1
            start, length = self._runs[i][0], self._runs.pop(i)[1] + length
        if i < len(self._runs) and self._runs[i][0] == start + length:
            length += self._runs.pop(i)[1]
        self._runs.insert(i, (start, length))


@dataclass
class _Slot:
    """One adapter handle: the resident adapter (None when free or vacated), its pages and the
    references running requests hold to it."""

    digest: str | None
    pages: Pages
    refs: int = 0
    acquired_at: int = 0  # acquire counter value, for least-recently-acquired order


class AdapterMemory:
    """Paged adapter memory keyed by adapter digest. An adapter in use by a running request is
    never evicted; idle ones are evicted least recently used first. A slot is a small handle of
    a resident adapter, reused lowest first."""

    def __init__(
        self, units: int, page_units: tuple[int, ...], unit_bytes: int = 1, runs: frozenset[int] = frozenset()
    ):
        """runs: the targets whose pages are one run of adjacent units (page_units 1)."""
        self.units, self.page_units, self.unit_bytes, self.runs = units, page_units, unit_bytes, runs
        self._free = _FreeRuns([(0, units)] if units else [])
        self._slots: list[_Slot] = []
        self._slot_of: dict[str, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unused; least recent first
        self._clock = 0
        self.activations = self.evictions = 0

    @classmethod
    def for_model(cls, units: int, model: ModelConfig, dtype: torch.dtype) -> "AdapterMemory":
        """`units` units of memory for `model`'s LoRA targets and vocabulary side in `dtype`."""
        sizes = page_units(model)
        return cls(units, sizes, unit_bytes(model, dtype), frozenset({len(sizes) - 1}))

    def resident(self, digest: str) -> int | None:
        """The slot of `digest`, if resident."""
        return self._slot_of.get(digest)

    def resident_digests(self) -> frozenset[str]:
        return frozenset(self._slot_of)

    def pages(self, slot: int) -> Pages:
        """Per target: the first unit of each of the slot's pages, in rank order (page g holds
        ranks PAGE_RANK*g .. PAGE_RANK*g + 7); no pages once vacated."""
        return self._slots[slot].pages

    def fits(self, need: tuple[int, ...]) -> bool:
        """Whether an adapter needing `need` pages per target could ever be held: it fits in the
        empty memory."""
        return _units(need, self.page_units) <= self.units

    def bytes_for(self, need: tuple[int, ...]) -> int:
        """Device bytes an adapter needing `need` pages per target takes."""
        return _units(need, self.page_units) * self.unit_bytes

    def can_acquire(self, digest: str, need: tuple[int, ...]) -> bool:
        """Whether acquire would succeed without waiting for a release: `digest` is resident, or
        its pages fit in the free units once every idle adapter is evicted. Changes nothing."""
        return (
            self.resident(digest) is not None
            or _first_fit(self._free_of_idle(), self.page_units, need, self.runs) is not None
        )

    def acquire(
        self, digest: str, need: tuple[int, ...], keep: frozenset[str] = frozenset()
    ) -> tuple[int, bool]:
        """A reference to `digest`'s slot: (slot, True when its weights must be copied in).
        A new adapter evicts idle adapters until its pages fit (placed first-fit, largest pages
        first): least recently used first, but those not in `keep` (the digests waiting requests
        use) before those in it. Precondition: can_acquire(digest, need) is True."""
        slot = self.resident(digest)
        activate = slot is None
        if activate:
            slot = self._activate(digest, self._make_room(need, keep))
        entry = self._slots[slot]
        entry.refs += 1
        self._idle.pop(slot, None)
        self._clock += 1
        entry.acquired_at = self._clock
        return slot, activate

    def vacate(self, slot: int) -> None:
        """The slot's weights are gone (a failed copy): its pages are free and its digest no
        longer resident. The handle is reused once its holders release it."""
        entry = self._slots[slot]
        _give_pages(self._free, self.page_units, entry.pages)
        self._slot_of.pop(entry.digest, None)
        self._idle.pop(slot, None)
        entry.digest, entry.pages = None, tuple(() for _ in self.page_units)

    def release(self, slot: int) -> None:
        """Drop one reference. At 0 the adapter stays resident, idle, at the most recently used
        end; a vacated slot's handle becomes free."""
        entry = self._slots[slot]
        entry.refs -= 1
        if entry.refs == 0 and entry.digest is not None:
            self._idle[slot] = None

    def drain_for(self, need: tuple[int, ...]) -> frozenset[int]:
        """The busy slots to drain for an adapter needing `need` pages: the least recently
        acquired ones, as few as make room once they and every idle adapter are gone. Nothing
        new joins them, so they stay the oldest until they drain."""
        busy = sorted(
            (s for s, e in enumerate(self._slots) if e.refs and e.digest),
            key=lambda s: self._slots[s].acquired_at,
        )
        free = self._free_of_idle()
        for count, slot in enumerate(busy):
            if _first_fit(free.copy(), self.page_units, need, self.runs) is not None:
                return frozenset(busy[:count])
            _give_pages(free, self.page_units, self._slots[slot].pages)
        return frozenset(busy)

    def stats(self) -> SlotStats:
        used = self.units - self._free.total
        return SlotStats(
            self.activations,
            self.evictions,
            self.active,
            used * self.unit_bytes,
            self.units * self.unit_bytes,
        )

    @property
    def active(self) -> int:
        """Adapters (and vacated handles) in use by running requests."""
        return sum(1 for entry in self._slots if entry.refs)

    def _free_of_idle(self) -> _FreeRuns:
        """A copy of the free units as they would be with every idle adapter evicted."""
        free = self._free.copy()
        for idle in self._idle:
            _give_pages(free, self.page_units, self._slots[idle].pages)
        return free

    def _make_room(self, need: tuple[int, ...], keep: frozenset[str]) -> Pages:
        """Pages for `need`, taken from the free units after evicting as few idle adapters as
        the eviction order allows."""
        victims = iter(sorted(self._idle, key=lambda s: self._slots[s].digest in keep))
        while (pages := self._take(need)) is None:
            victim = next(victims, None)
            if victim is None:
                raise MemoryError(f"adapter memory cannot place {need} pages; call can_acquire first")
            self._evict(victim)
        return pages

    def _take(self, need: tuple[int, ...]) -> Pages | None:
        """First-fit pages for `need`, cut from the free units; None (nothing cut) if they do not fit."""
        free = self._free.copy()
        pages = _first_fit(free, self.page_units, need, self.runs)
        if pages is not None:
            self._free = free
        return pages

    def _evict(self, slot: int) -> None:
        self.vacate(slot)
        self.evictions += 1

    def _activate(self, digest: str, pages: Pages) -> int:
        """The lowest free handle, now holding `digest` at `pages`."""
        entry = _Slot(digest, pages)
        slot = next((s for s, e in enumerate(self._slots) if e.digest is None and not e.refs), None)
        if slot is None:
            slot = len(self._slots)
            self._slots.append(entry)
        else:
            self._slots[slot] = entry
        self._slot_of[digest] = slot
        self.activations += 1
        return slot


def _first_fit(
    free: _FreeRuns, page_units: tuple[int, ...], need: tuple[int, ...], runs: frozenset[int]
) -> Pages | None:
    """Pages for `need` cut from `free`, largest pages first (a run target's run as one page of
    its length), each in the first run long enough; None when one does not fit (`free` is then
    partly cut: pass a copy)."""
    if len(need) != len(page_units):
        raise ValueError(f"need {need} names {len(need)} targets; the memory has {len(page_units)}")
    starts: list[tuple[int, ...]] = [() for _ in need]
    # (pages, units each): a run target's run is one page of its length, its units its pages
    shapes = [(min(n, 1), n) if t in runs else (n, page_units[t]) for t, n in enumerate(need)]
    for t in sorted(range(len(need)), key=lambda t: -shapes[t][1]):
        count, length = shapes[t]
        for _ in range(count):
            start = free.take(length)
            if start is None:
                return None
            starts[t] += tuple(range(start, start + length)) if t in runs else (start,)
    return tuple(starts)


def _give_pages(free: _FreeRuns, page_units: tuple[int, ...], pages: Pages) -> None:
    """Return every page of `pages` to `free`."""
    for size, starts in zip(page_units, pages, strict=True):
        for start in starts:
            free.give(start, size)
