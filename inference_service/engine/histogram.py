"""Histogram: cumulative-bucket counts of observed values, Prometheus style, for export."""

import bisect
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Cumulative-bucket histogram, Prometheus style: counts[i] observations <= buckets[i]."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * len(self.buckets)

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.total, self.count)

    def observe(self, value: float) -> None:
        for i in range(bisect.bisect_left(self.buckets, value), len(self.buckets)):
            self.counts[i] += 1
        self.total += value
        self.count += 1
