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

from inference_service.engine import Engine
from inference_service.server.admission import Admission
from inference_service.server.engine_collector import EngineCollector
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
