"""MetricsEndpoint: one process's Prometheus registry served over HTTP at /metrics (the worker's
and the store's `--metrics-listen HOST:PORT`), on prometheus-client's own threaded HTTP server,
so a slow scrape never waits on the gRPC event loop."""

import logging

from prometheus_client import CollectorRegistry, start_http_server

from shared.errors import InvalidArgument

log = logging.getLogger(__name__)


def metrics_address(listen: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT, "[v6 address]:PORT" too; InvalidArgument naming the value."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"metrics address {listen!r} is not HOST:PORT (port 0 picks a free one)")
    return host.removeprefix("[").removesuffix("]"), int(port)


class MetricsEndpoint:
    """Serves `registry` from construction until close()."""

    def __init__(self, listen: str, registry: CollectorRegistry):
        host, port = metrics_address(listen)
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as e:
            raise InvalidArgument(f"cannot serve metrics on {listen}: {e.strerror}") from None
        self.address = f"{listen.rpartition(':')[0]}:{self._server.server_port}"
        log.info("Prometheus metrics on http://%s/metrics", self.address)

    def close(self) -> None:
        """Stop answering scrapes and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
