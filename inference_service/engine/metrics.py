"""Counters, gauges and a histogram the engine keeps for the gRPC layer to export."""

from collections import Counter
from dataclasses import dataclass, field

from inference_service.adapters.host_tier import HostTierStats
from inference_service.engine.adapter_memory import SlotStats
from inference_service.engine.grammars import GrammarStats
from inference_service.engine.histogram import Histogram
from inference_service.engine.rank_group import RankReport
from inference_service.engine.scheduler import SchedulerStats
from inference_service.engine.sequence import Sequence

LOAD_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of every counter and gauge of an engine, for export."""

    requests: dict[tuple[str, str], int]  # (adapter or "", finish reason) -> count
    prompt_tokens: int
    generation_tokens: int
    adapter_load_seconds: Histogram
    host_tier: HostTierStats
    slots: SlotStats
    scheduler: SchedulerStats
    ranks: tuple[RankReport, ...]  # what each tensor-parallel rank holds (rank 0 alone at one rank)
    collective_seconds: float  # rank 0's time in exchanges with the other ranks, so far
    grammars: GrammarStats  # structured outputs: constrained requests and their compiles


@dataclass
class EngineMetrics:
    requests: Counter = field(default_factory=Counter)  # (adapter or "", finish reason) -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    adapter_load_seconds: Histogram = field(default_factory=lambda: Histogram(LOAD_SECONDS_BUCKETS))

    def count_finished(self, seq: Sequence) -> None:
        self.requests[(seq.adapter or "", seq.finish_reason)] += 1
        self.prompt_tokens += len(seq.prompt_token_ids)
        self.generation_tokens += len(seq.output_token_ids)

    def snapshot(
        self,
        host_tier: HostTierStats,
        slots: SlotStats,
        scheduler: SchedulerStats,
        grammars: GrammarStats,
        ranks: tuple[RankReport, ...] = (),
        collective_seconds: float = 0.0,
    ) -> EngineStats:
        return EngineStats(
            dict(self.requests),
            self.prompt_tokens,
            self.generation_tokens,
            self.adapter_load_seconds.copy(),
            host_tier,
            slots,
            scheduler,
            ranks,
            collective_seconds,
            grammars,
        )
