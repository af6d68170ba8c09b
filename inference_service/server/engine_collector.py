"""EngineCollector: the engine's counters and gauges as Prometheus series, read from one
`engine.stats()` snapshot per scrape, so the step never touches Prometheus. Names follow vLLM's
(`vllm:` becomes `loramux:`), `loramux:lora_requests_info` included."""

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from inference_service.engine import Engine, EngineStats
from inference_service.engine.histogram import Histogram as EngineHistogram


class EngineCollector(Collector):
    """The engine's counters and gauges, from one stats snapshot per scrape."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats, config = self._engine.stats(), self._engine.config
        yield from _request_families(stats)
        yield from _scheduler_families(stats)
        yield from _slot_families(stats)
        yield from _host_tier_families(stats, config.max_cpu_loras)
        yield from _rank_families(stats)
        yield _histogram(
            "loramux:adapter_load_seconds",
            "Seconds to make an adapter ready in host "
            "memory (fetch, verify, prepare); its count is the loads",
            stats.adapter_load_seconds,
        )
        yield from _grammar_families(stats)
        yield _lora_requests_info(stats, config.max_loras)


def _request_families(stats: EngineStats) -> Iterator[Metric]:
    finished = CounterMetricFamily(
        "loramux:requests_finished",
        "Requests the engine finished, by adapter and finish reason (length, stop, abort, error)",
        labels=["adapter", "finished_reason"],
    )
    for (adapter, reason), count in sorted(stats.requests.items()):
        finished.add_metric([adapter, reason], count)
    yield finished
    yield CounterMetricFamily(
        "loramux:prompt_tokens", "Prompt tokens of finished requests", stats.prompt_tokens
    )
    yield CounterMetricFamily(
        "loramux:generation_tokens", "Tokens generated for finished requests", stats.generation_tokens
    )


def _scheduler_families(stats: EngineStats) -> Iterator[Metric]:
    s = stats.scheduler
    yield GaugeMetricFamily("loramux:num_requests_running", "Requests admitted to run", s.running)
    yield GaugeMetricFamily(
        "loramux:num_requests_waiting", "Requests queued for admission (or their adapter's load)", s.waiting
    )
    yield GaugeMetricFamily(
        "loramux:kv_cache_blocks_used", "KV cache blocks held by requests", s.kv_blocks_used
    )
    yield GaugeMetricFamily(
        "loramux:kv_cache_blocks_total", "KV cache blocks of the worker", s.kv_blocks_total
    )
    yield GaugeMetricFamily(
        "loramux:kv_cache_usage_perc",
        "Fraction of KV cache blocks held by running requests, 0 to 1 (cached free ones not counted)",
        s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
    )
    yield GaugeMetricFamily(
        "loramux:kv_cache_blocks_cached",
        "KV cache blocks no request holds that keep a prefix for later requests",
        s.kv_blocks_cached,
    )
    yield CounterMetricFamily(
        "loramux:num_preemptions",
        "Running requests that gave their KV blocks back to be computed again",
        s.preemptions,
    )
    yield CounterMetricFamily(
        "loramux:prefix_cache_queries",
        "Tokens of admitted requests looked up in the prefix cache",
        s.prefix_cache_queries,
    )
    yield CounterMetricFamily(
        "loramux:prefix_cache_hits",
        "Tokens of admitted requests found in the prefix cache",
        s.prefix_cache_hits,
    )


def _slot_families(stats: EngineStats) -> Iterator[Metric]:
    """Device adapter memory: every read of SlotStats is here, so a change of its fields is one
    change here."""
    slots = stats.slots
    yield GaugeMetricFamily(
        "loramux:adapter_slots_active", "Adapters in device memory that running requests use", slots.active
    )
    yield GaugeMetricFamily(
        "loramux:adapter_memory_used_bytes", "Device adapter memory holding adapters", slots.bytes_used
    )
    yield GaugeMetricFamily(
        "loramux:adapter_memory_total_bytes", "Device adapter memory (--adapter-memory)", slots.bytes_total
    )
    yield CounterMetricFamily(
        "loramux:adapter_slot_activations", "Adapters copied into device memory", slots.activations
    )
    yield CounterMetricFamily(
        "loramux:adapter_slot_evictions", "Adapters dropped from device memory for another", slots.evictions
    )


def _host_tier_families(stats: EngineStats, capacity: int) -> Iterator[Metric]:
    host = stats.host_tier
    yield GaugeMetricFamily("loramux:host_tier_adapters", "Adapters ready in host memory", host.size)
    yield GaugeMetricFamily(
        "loramux:host_tier_capacity",
        "Unpinned adapters host memory keeps at most (--max-cpu-loras)",
        capacity,
    )
    yield CounterMetricFamily("loramux:host_tier_hits", "Adapter lookups that found it ready", host.hits)
    yield CounterMetricFamily("loramux:host_tier_misses", "Adapter lookups that started a load", host.misses)
    yield CounterMetricFamily(
        "loramux:host_tier_request_hits",
        "Requests whose adapter was ready in host memory when they arrived",
        host.request_hits,
    )
    yield CounterMetricFamily(
        "loramux:host_tier_request_misses",
        "Requests whose adapter was not ready in host memory when they arrived",
        host.request_misses,
    )
    yield CounterMetricFamily(
        "loramux:host_tier_evictions", "Adapters dropped from host memory", host.evictions
    )


def _rank_families(stats: EngineStats) -> Iterator[Metric]:
    """Each tensor-parallel rank's device memory, and rank 0's time in exchanges with the others."""
    parts = {
        "weight": "Bytes of the model's weights a tensor-parallel rank holds",
        "adapter_memory": "Bytes of adapter memory a tensor-parallel rank holds",
        "kv_cache": "Bytes of KV cache a tensor-parallel rank holds",
    }
    for part, documentation in parts.items():
        family = GaugeMetricFamily(f"loramux:rank_{part}_bytes", documentation, labels=["rank"])
        for report in stats.ranks:
            family.add_metric([str(report.rank)], getattr(report, f"{part}_bytes"))
        yield family
    yield CounterMetricFamily(
        "loramux:collective_seconds",
        "Seconds rank 0 spent in exchanges with the other tensor-parallel ranks",
        stats.collective_seconds,
    )


def _grammar_families(stats: EngineStats) -> Iterator[Metric]:
    """Structured outputs: every read of GrammarStats is here."""
    grammars = stats.grammars
    yield CounterMetricFamily(
        "loramux:structured_requests",
        "Requests with an output constraint (a JSON schema, JSON object, regex, choice or grammar)",
        grammars.requests,
    )
    yield CounterMetricFamily(
        "loramux:grammar_cache_hits",
        "Constrained requests whose constraint was compiled already, or compiling",
        grammars.hits,
    )
    yield _histogram(
        "loramux:grammar_compile_seconds",
        "Seconds to compile an output constraint (--grammar-compile-timeout bounds the wait, "
        "not the compile); its count is the compiles",
        grammars.compile_seconds,
    )


def _histogram(name: str, documentation: str, h: EngineHistogram) -> HistogramMetricFamily:
    buckets = [(str(bound), count) for bound, count in zip(h.buckets, h.counts, strict=True)]
    return HistogramMetricFamily(name, documentation, [*buckets, ("+Inf", h.count)], h.total)


def _lora_requests_info(stats: EngineStats, max_loras: int) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info`: one series whose labels name the adapters of running and of
    waiting requests (comma-separated, each once, oldest request first) and the most adapters a
    step runs; its value is the scrape time, which routers use to pick the newest series."""
    running, waiting = stats.scheduler.running_adapters, stats.scheduler.waiting_adapters
    info = GaugeMetricFamily(
        "loramux:lora_requests_info",
        "Running stats on LoRA requests",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(running), ",".join(waiting), str(max_loras)], time.time())
    return info
