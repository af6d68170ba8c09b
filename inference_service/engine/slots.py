"""SlotPool: which adapter occupies each device slot, who uses it, and which slot goes next."""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotStats:
    activations: int  # adapters copied into a slot
    evictions: int  # activations that replaced another adapter
    active: int  # slots in use by running requests


class SlotPool:
    """Device slots keyed by adapter digest. A slot in use by a running request is never
    evicted; idle slots are reused least recently used first."""

    def __init__(self, num_slots: int):
        self._digest_of: list[str | None] = [None] * num_slots
        self._refs = [0] * num_slots
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._acquired_at = [0] * num_slots  # acquire counter value, for least-recently-used order
        self._clock = 0
        self.activations = self.evictions = 0

    def resident(self, digest: str) -> int | None:
        """The slot holding `digest`, if any."""
        return next((s for s, d in enumerate(self._digest_of) if d == digest), None)

    def can_acquire(self, digest: str, avoid: int | None = None) -> bool:
        return self.resident(digest) is not None or any(s != avoid for s in self._idle)

    def acquire(self, digest: str, keep: frozenset[str] = frozenset()) -> tuple[int, bool]:
        """A reference to a slot for `digest`: (slot, True when its weights must be copied in).
        A new adapter takes the least recently used idle slot, preferring one whose adapter is
        not in `keep` (the digests waiting requests use)."""
        slot = self.resident(digest)
        activate = slot is None
        if activate:
            slot = next((s for s in self._idle if self._digest_of[s] not in keep), next(iter(self._idle)))
            self.evictions += self._digest_of[slot] is not None
            self.activations += 1
            self._digest_of[slot] = digest
        self._refs[slot] += 1
        self._idle.pop(slot, None)
        self._clock += 1
        self._acquired_at[slot] = self._clock
        return slot, activate

    def vacate(self, slot: int) -> None:
        """The slot's weights are gone (a failed activation): no adapter is resident there."""
        self._digest_of[slot] = None

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None  # most recently used end

    def lru_busy_slot(self) -> int | None:
        """The busy slot acquired longest ago: the one to drain when a waiting request finds no
        idle slot. Nothing new is admitted to it, so it stays the oldest until it drains."""
        busy = [s for s, refs in enumerate(self._refs) if refs]
        return min(busy, key=self._acquired_at.__getitem__, default=None)

    def stats(self) -> SlotStats:
        return SlotStats(self.activations, self.evictions, self.active)

    @property
    def active(self) -> int:
        return sum(1 for refs in self._refs if refs)
