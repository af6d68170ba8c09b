"""A real store process started with --metrics-listen 127.0.0.1:0: its /metrics, scraped over HTTP
and parsed by prometheus-client, counts calls by method and status (refusals by the token check
too), times registrations, and reports the catalog, the blob bytes, fetches and watch streams."""

import grpc
import pytest

from adapter_store.__main__ import parse_config
from shared.errors import InvalidArgument
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import ADMIN_TOKEN, AUTH, StoreProcess
from tests.prometheus_scrape import logged_metrics_address, scrape, scrape_until, value

RPCS = "loramux_store_rpcs_total"


@pytest.fixture(scope="module")
def store(tmp_path_factory, sources_root, tiny_models):
    flags = ["--allowed-root", str(sources_root), "--admin-token", ADMIN_TOKEN]
    flags += ["--base-model", str(tiny_models["llama"]), "--max-lora-rank", "16"]
    process = StoreProcess(
        tmp_path_factory.mktemp("metrics-store"), [*flags, "--metrics-listen", "127.0.0.1:0"]
    )
    process.start()
    process.metrics = logged_metrics_address(process.log)
    yield process
    assert process.stop() == 0


def test_calls_catalog_fetches_and_watches_are_reported(store, sources_root):
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        sizes = {name: _register(stub, name, sources_root).size_bytes for name in ("all8", "qv4")}
        _register(stub, "all8", sources_root)  # same content: answered, nothing new
        stub.PinAdapter(pb.PinAdapterRequest(adapter_id="all8"), metadata=AUTH)
        with pytest.raises(grpc.RpcError):
            stub.GetAdapter(pb.GetAdapterRequest(adapter_id="no-such-adapter"), metadata=AUTH)
        with pytest.raises(grpc.RpcError):
            stub.ListAdapters(pb.ListAdaptersRequest())  # no token
        fetched = b"".join(r.chunk for r in stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id="all8")))
        watch = stub.WatchAdapters(pb.WatchAdaptersRequest())
        next(watch)
        samples = scrape(store.metrics)

        assert value(samples, RPCS, method="RegisterAdapter", code="OK") == 3
        assert value(samples, RPCS, method="PinAdapter", code="OK") == 1
        assert value(samples, RPCS, method="GetAdapter", code="NOT_FOUND") == 1
        assert value(samples, RPCS, method="ListAdapters", code="UNAUTHENTICATED") == 1
        assert value(samples, RPCS, method="FetchAdapter", code="OK") == 1
        assert value(samples, "loramux_store_rpc_duration_seconds_count", method="RegisterAdapter") == 3
        assert value(samples, "loramux_store_fetch_bytes_total") == len(fetched) == sizes["all8"]
        assert value(samples, "loramux_store_adapters") == 2
        assert value(samples, "loramux_store_adapters_pinned") == 1
        assert value(samples, "loramux_store_blob_bytes") == sum(sizes.values())
        assert value(samples, "loramux_store_watch_streams") == 1

        watch.cancel()
        samples = scrape_until(store.metrics, lambda s: value(s, "loramux_store_watch_streams") == 0)
        assert value(samples, "loramux_store_watch_streams") == 0
        assert value(samples, RPCS, method="WatchAdapters", code="CANCELLED") == 1


def test_metrics_listen_must_be_host_and_port(tmp_path):
    with pytest.raises(InvalidArgument, match="metrics address 'localhost' is not HOST:PORT"):
        parse_config(["--data-dir", str(tmp_path), "--metrics-listen", "localhost"])


def _register(stub, name: str, sources_root) -> pb.Adapter:
    request = pb.RegisterAdapterRequest(adapter_id=name, source_uri=f"file://{sources_root / name}")
    return stub.RegisterAdapter(request, metadata=AUTH)
