"""MetricsEndpoint: a registry served over real HTTP on loopback, refused ports named, and the
port given back on close."""

import socket
import urllib.error

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.errors import InvalidArgument
from shared.metrics_endpoint import MetricsEndpoint
from tests.prometheus_scrape import scrape, value


def test_serves_its_registry_until_closed():
    registry = CollectorRegistry()
    Counter("loramux_test_events", "events", registry=registry).inc(3)
    endpoint = MetricsEndpoint("127.0.0.1:0", registry)
    assert value(scrape(endpoint.address), "loramux_test_events_total") == 3
    endpoint.close()
    with pytest.raises(urllib.error.URLError):
        scrape(endpoint.address)
    MetricsEndpoint(endpoint.address, registry).close()  # the port is free again


def test_a_taken_port_is_refused_by_name():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(InvalidArgument, match=f"cannot serve metrics on {address}"):
            MetricsEndpoint(address, CollectorRegistry())


@pytest.mark.parametrize("listen", ["9090", "host:", "host:http", "host:70000"])
def test_anything_but_host_and_port_is_refused(listen):
    with pytest.raises(InvalidArgument, match=f"metrics address '{listen}' is not HOST:PORT"):
        MetricsEndpoint(listen, CollectorRegistry())
