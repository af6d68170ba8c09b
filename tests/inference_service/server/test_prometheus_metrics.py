"""A real worker process started with --metrics-listen 127.0.0.1:0, fetching adapters from a real
store: its /metrics, scraped over HTTP and parsed by prometheus-client, counts the Generate calls
by adapter and status, times the streams, sums their tokens and names running and waiting
adapters the way vLLM's lora_requests_info does. A second worker, on a model with a tokenizer and
no store, counts constrained requests and their compiles."""

import json
import time

import grpc
import pytest

from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.adapter_store.conftest import s3_endpoint, sources_root  # noqa: F401 - fixtures
from tests.e2e.conftest import WorkerProcess, admin, long_model, register, store  # noqa: F401
from tests.prometheus_scrape import find, logged_metrics_address, scrape, scrape_until, value

CALLS = "loramux:generate_requests_total"


@pytest.fixture(scope="module")
def worker(tmp_path_factory, long_model, store, admin, sources_root):  # noqa: F811
    for name in ("all8", "qv4"):
        register(admin, name, f"file://{sources_root / name}")
    cache = tmp_path_factory.mktemp("metrics-worker") / "cache"
    # adapter memory for one rank-8 adapter on every module: all8 fills it, qv4 waits for it
    flags = ["--max-loras", "1", "--max-lora-rank", "8", "--max-cpu-loras", "2", "--kv-cache-tokens", "8192"]
    process = WorkerProcess(long_model, store.address, cache, *flags, "--metrics-listen", "127.0.0.1:0")
    process.start()
    process.metrics = logged_metrics_address(process.log)
    yield process
    process.terminate()
    assert process.wait() == 0


@pytest.fixture
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield inference_grpc.InferenceServiceStub(channel)


def _request(adapter: str, ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(adapter=adapter, token_ids=pb.TokenIds(ids=ids), sampling=params)


def _tokens(stub, request) -> list[int]:
    return [t for r in stub.Generate(request, timeout=60) if r.HasField("delta") for t in r.delta.token_ids]


def test_calls_are_counted_by_adapter_and_status_and_streams_timed(worker, stub):
    before = scrape(worker.metrics)
    base = _tokens(stub, _request("", [5, 6, 7], 5))
    adapted = _tokens(stub, _request("all8", [8, 9], 4))
    with pytest.raises(grpc.RpcError) as refused:
        _tokens(stub, _request("no-such-adapter", [5], 2))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    after = scrape(worker.metrics)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew(CALLS, adapter="", code="OK") == 1
    assert grew(CALLS, adapter="all8", code="OK") == 1
    assert grew(CALLS, adapter="<unknown>", code="NOT_FOUND") == 1  # a made-up name is no label
    assert grew("loramux:time_to_first_token_seconds_count") == 2
    assert grew("loramux:e2e_request_latency_seconds_count") == 2
    assert grew("loramux:inter_token_latency_seconds_count") == len(base) + len(adapted) - 2
    assert grew("loramux:generation_tokens_total") == len(base) + len(adapted) == 9
    assert grew("loramux:prompt_tokens_total") == 5
    assert grew("loramux:requests_finished_total", adapter="all8", finished_reason="length") == 1
    assert value(after, "loramux:adapter_load_seconds_count") == 1  # all8 fetched from the store
    assert value(after, "loramux:host_tier_adapters") == 1
    assert value(after, "loramux:host_tier_capacity") == 2
    total = value(after, "loramux:adapter_memory_total_bytes")
    assert total > 0 and value(after, "loramux:adapter_memory_used_bytes") == total  # all8 fills it
    assert value(after, "loramux:kv_cache_blocks_total") > 0
    assert value(after, "process_resident_memory_bytes") > 0
    # all8's first request found it not ready; its next finds it held, whatever the lookups counted
    assert grew("loramux:host_tier_request_misses_total") == 1
    assert grew("loramux:host_tier_request_hits_total") == 0
    _tokens(stub, _request("all8", [8, 9], 1))
    again = scrape(worker.metrics)
    assert (
        value(again, "loramux:host_tier_request_hits_total")
        - value(after, "loramux:host_tier_request_hits_total")
        == 1
    )
    assert value(again, "loramux:host_tier_request_misses_total") == value(
        after, "loramux:host_tier_request_misses_total"
    )


def test_lora_requests_info_names_running_and_waiting_adapters(worker, stub):
    before = scrape(worker.metrics)
    running = stub.Generate(_request("all8", [5, 6], 4000), timeout=60)
    next(running)  # all8 streams: it holds the adapter memory until it ends
    waiting = stub.Generate(_request("qv4", [7], 3), timeout=60)
    scrape_until(worker.metrics, lambda s: _lora_info(s).labels["waiting_lora_adapters"] == "qv4")
    # Read again: within one scrape the call gauges are read before the engine's snapshot (which
    # waits for the step in progress), so the scrape that first shows qv4 waiting can predate
    # its call's arrival; the state it shows holds until all8 lets go.
    samples = scrape(worker.metrics)
    info = _lora_info(samples)
    assert info.labels == {"running_lora_adapters": "all8", "waiting_lora_adapters": "qv4", "max_lora": "1"}
    assert abs(info.value - time.time()) < 30  # the scrape time, as vLLM sets it
    assert value(samples, "loramux:num_requests_running") == 1
    assert value(samples, "loramux:num_requests_waiting") == 1
    assert value(samples, "loramux:generate_calls_in_flight") == 2
    assert value(samples, "loramux:adapter_slots_active") == 1
    assert value(samples, "loramux:kv_cache_usage_perc") > 0

    running.cancel()
    tokens = [t for r in waiting if r.HasField("delta") for t in r.delta.token_ids]
    assert len(tokens) == 3  # admitted once all8 let go (a reader behind gets tokens joined)
    after = scrape_until(worker.metrics, lambda s: value(s, CALLS, adapter="all8", code="CANCELLED") > 0)
    assert (
        value(after, CALLS, adapter="all8", code="CANCELLED")
        - value(before, CALLS, adapter="all8", code="CANCELLED")
        == 1
    )
    assert _lora_info(after).labels["running_lora_adapters"] == ""


def _lora_info(samples):
    (info,) = find(samples, "loramux:lora_requests_info")
    return info


def test_prefix_cache_use_and_preemptions_are_exported(worker, stub):
    """In tokens, as vLLM counts them: a 40-token prompt sent twice is queried twice, and its
    second admission finds its 2 full blocks of 16 cached (its last token is always computed)."""
    prompt = list(range(100, 140))
    before = scrape(worker.metrics)
    for _ in range(2):
        _tokens(stub, _request("", prompt, 1))
    after = scrape_until(worker.metrics, lambda s: value(s, "loramux:prefix_cache_hits_total") > 0)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    assert (grew("loramux:prefix_cache_queries_total"), grew("loramux:prefix_cache_hits_total")) == (80, 32)
    assert value(after, "loramux:kv_cache_blocks_cached") >= 2  # kept for the next request
    assert value(after, "loramux:kv_cache_usage_perc") == 0  # none held: nothing runs
    assert value(after, "loramux:num_preemptions_total") == 0


@pytest.fixture(scope="module")
def chat_worker(tmp_path_factory, tiny_chat_model):
    """A worker whose model has a tokenizer, which constrained requests need; base model only."""
    cache = tmp_path_factory.mktemp("metrics-chat-worker") / "cache"
    flags = ["--kv-cache-tokens", "1024", "--metrics-listen", "127.0.0.1:0"]
    process = WorkerProcess(tiny_chat_model, None, cache, *flags)
    process.start()
    process.metrics = logged_metrics_address(process.log)
    yield process
    process.terminate()
    assert process.wait() == 0


def test_constrained_requests_and_their_compiles_are_exported(chat_worker):
    """The same constraint twice: two constrained requests, one compile, one cache hit."""
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    params = pb.SamplingParams(max_tokens=12, temperature=0, json_schema=schema)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=params)
    before = scrape(chat_worker.metrics)
    with grpc.insecure_channel(chat_worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        for _ in range(2):
            assert _tokens(stub, request)
        _tokens(stub, _request("", [5, 6, 7], 3))  # unconstrained: counted nowhere here
    after = scrape(chat_worker.metrics)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    assert grew("loramux:structured_requests_total") == 2
    assert grew("loramux:grammar_cache_hits_total") == 1
    assert grew("loramux:grammar_compile_seconds_count") == 1
    assert grew("loramux:grammar_compile_seconds_sum") > 0
    assert value(after, "loramux:grammar_compile_seconds_bucket", le="+Inf") == 1
