"""Snapshot: what readers outside the step see of an engine (stats, adapters held), taken after
every step and adapter change, so GetStats, /metrics and ListAdapters answer while a long step
runs."""

from dataclasses import dataclass

from inference_service.engine.metrics import EngineStats


@dataclass(frozen=True, order=True)
class AdapterState:
    name: str
    digest: str  # empty while loading
    location: str  # "device" | "host" | "loading"
    pinned: bool


@dataclass(frozen=True)
class Snapshot:
    """Taken by whoever holds the step lock, swapped in whole, and cheap to take (a step takes
    one): readers build the adapter listing from it."""

    stats: EngineStats
    held: list[tuple[str, str | None, bool]]  # HostTier.held(): never changed once taken
    resident: frozenset[str]  # digests in adapter memory

    def adapters(self) -> list[AdapterState]:
        """Every adapter held: in a device slot, in host memory, or loading; by name."""
        return sorted(
            AdapterState(name, digest or "", self._location(digest), pinned)
            for name, digest, pinned in self.held
        )

    def held_digests(self) -> dict[str, str]:
        """Adapter name -> digest of every adapter ready in host memory."""
        return {name: digest for name, digest, _ in self.held if digest is not None}

    def _location(self, digest: str | None) -> str:
        if digest is None:
            return "loading"
        return "device" if digest in self.resident else "host"
