"""GatewayMetrics: the gateway's Prometheus series, in one registry per process, and the ASGI
middleware that observes every HTTP request."""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
UNMATCHED = "<unmatched>"  # the route label of a path no route serves: a bounded label set


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "loramux_gateway_http_requests",
            "HTTP requests by route, model (empty when refused before reaching a model) and status",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "loramux_gateway_http_request_duration_seconds",
            "From a request's arrival to the last byte of its response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_token = Histogram(
            "loramux_gateway_time_to_first_token_seconds",
            "From a completion request's arrival to every sample's first token from the worker",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


class MetricsMiddleware:
    """Counts each request by its route's path template (not the raw path) once its response ends."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def observe_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe_status)
        finally:
            route = getattr(scope.get("route"), "path", UNMATCHED)
            model = scope.get("state", {}).get("model", "")
            self.metrics.requests.labels(route, model, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
