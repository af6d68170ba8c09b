"""WorkerMetrics: the worker's Prometheus series, in one registry per process.

Generate calls are observed as they happen (final status, time to first token, inter-token
latency, end to end). Everything the engine counts is read from one `engine.stats()` snapshot per
scrape, so the step never touches Prometheus. Names follow vLLM's (`vllm:` becomes `loramux:`),
`loramux:lora_requests_info` included, so LoRA-aware routers that read vLLM's series read these
with the prefix changed."""

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from inference_service.engine import Engine, EngineStats
from inference_service.engine.histogram import Histogram as EngineHistogram
from inference_service.server.admission import Admission
from shared.errors import LoramuxError
from shared.grpc_server import status_of
from shared.names import ADAPTER_ID

# Seconds. Decode steps take milliseconds on a GPU and tens of them on a CPU; a first token also
# waits for the queue and an adapter load, and a whole request can run for minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# The adapter label of a call whose adapter name this worker does not serve (see adapter_label).
UNKNOWN_ADAPTER = "<unknown>"


class GenerateCall:
    """The clock of one Generate call: the timings its final message carries, observed into the
    histograms as the tokens go out."""

    def __init__(self, metrics: "WorkerMetrics", adapter: str):
        self._metrics, self.adapter = metrics, adapter
        self._start = time.perf_counter()
        self._first_token_s: float | None = None
        self._last_token = self._start

    def tokens(self, count: int) -> None:
        """A message with `count` tokens is about to go out. Its first token's gap is measured
        from the previous message; the others reach the client with it, a gap of 0 (a stream
        that fell behind catches up in one message)."""
        now = time.perf_counter()
        if self._first_token_s is None:
            self._first_token_s = now - self._start
            self._metrics.time_to_first_token.observe(self._first_token_s)
        else:
            self._metrics.inter_token_latency.observe(now - self._last_token)
        for _ in range(count - 1):
            self._metrics.inter_token_latency.observe(0.0)
        self._last_token = now

    def finished(self) -> tuple[float, float]:
        """(time to first token, total) in seconds, for the final message; a call that produced
        no token reports its total as its time to first token."""
        total_s = time.perf_counter() - self._start
        self._metrics.e2e_latency.observe(total_s)
        return (self._first_token_s if self._first_token_s is not None else total_s), total_s


def adapter_label(adapter: str, code: grpc.StatusCode) -> str:
    """The adapter a call counts under: its name, "" for the base model. A name no adapter has
    (NOT_FOUND), or one from a request refused as malformed, counts as UNKNOWN_ADAPTER: names
    callers make up would otherwise add a series per typo, for as long as the worker runs."""
    if adapter == "":
        return ""
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
        return UNKNOWN_ADAPTER
    return adapter if ADAPTER_ID.fullmatch(adapter) else UNKNOWN_ADAPTER


class WorkerMetrics:
    """The series of one worker process, in `registry`."""

    def __init__(self, registry: CollectorRegistry, admission: Admission):
        self.registry = registry
        self.calls = Counter(
            "loramux:generate_requests",
            "Generate calls by the adapter they named and the gRPC status they ended with",
            ["adapter", "code"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "loramux:time_to_first_token_seconds",
            "Seconds from a Generate call's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "loramux:inter_token_latency_seconds",
            "Seconds between consecutive tokens of one stream",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "loramux:e2e_request_latency_seconds",
            "Seconds from a Generate call's arrival to its final message",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        in_flight = Gauge(
            "loramux:generate_calls_in_flight",
            "Generate calls held, from arrival to last message (at --max-pending more are refused)",
            registry=registry,
        )
        in_flight.set_function(lambda: admission.in_flight)
        ProcessCollector(registry=registry)

    @contextmanager
    def generate_call(self, adapter: str) -> Iterator[GenerateCall]:
        """Times the call and, however it ends, counts it under the status the caller gets."""
        call = GenerateCall(self, adapter)
        code = grpc.StatusCode.OK
        try:
            yield call
        except LoramuxError as e:
            code = status_of(e)
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the caller cancelled or went away
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            raise
        finally:
            self.calls.labels(adapter_label(adapter, code), code.name).inc()

    def watch_engine(self, engine: Engine) -> None:
        """From now on every scrape also reads the engine's counters and gauges."""
        self.registry.register(EngineCollector(engine))


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
