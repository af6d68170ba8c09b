"""The store and workers as real processes, driven through gRPC: mixed adapters, S3 adapters,
deletes, a store outage, a full queue, a cancel storm and a SIGTERM drain."""

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from tests.adapter_store.conftest import AUTH, upload_folder
from tests.conftest import TINY_ADAPTERS, build_peft_adapter
from tests.e2e.conftest import WorkerProcess, register, until

ADAPTERS = ("all8", "qv4", "mlp16rs", "re2")
# (adapter or None, prompt token ids, max_tokens)
WORKLOAD = [
    (None, [5, 6, 7, 8], 12),
    ("all8", [9, 10, 11], 10),
    ("qv4", [12, 13, 14, 15, 16], 14),
    ("mlp16rs", [17, 18], 9),
    ("re2", [19, 20, 21, 22], 11),
    ("all8", [23, 24, 25, 26, 27, 28], 8),
    ("qv4", [29], 13),
    (None, [30, 31, 32], 7),
]


def _request(adapter, ids, max_tokens, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)
    return pb.GenerateRequest(adapter=adapter or "", token_ids=pb.TokenIds(ids=ids), sampling=params)


def _tokens(stub, request) -> tuple[list[int], pb.Final]:
    tokens, final = [], None
    for response in stub.Generate(request, timeout=60):
        if response.HasField("delta"):
            tokens += response.delta.token_ids
        else:
            final = response.final
    return tokens, final


@pytest.fixture(scope="module")
def registered(admin, sources_root):
    for name in ADAPTERS:
        register(admin, name, f"file://{sources_root / name}")
    return ADAPTERS


@pytest.fixture(scope="module")
def in_process(long_model, tiny_adapters) -> dict[int, list[int]]:
    """Every WORKLOAD request's greedy tokens from the in-process engine."""
    engine = Engine(
        EngineConfig(model=str(long_model), max_loras=4, kv_cache_tokens=2048, max_model_len=2048)
    )
    for name in ADAPTERS:
        engine.add_adapter(name, tiny_adapters["llama"][name])
    requests = [
        Request(ids, adapter, SamplingParams(max_tokens=n, temperature=0)) for adapter, ids, n in WORKLOAD
    ]
    return {i: out.token_ids for i, out in enumerate(engine.generate(requests))}


def test_mixed_adapters_concurrently_equal_the_in_process_engine(generate, registered, in_process):
    with ThreadPoolExecutor(len(WORKLOAD)) as pool:
        results = list(pool.map(lambda w: _tokens(generate, _request(*w)), WORKLOAD))
    for i, (tokens, final) in enumerate(results):
        assert tokens == in_process[i], f"request {i} ({WORKLOAD[i][0]})"
        assert final.usage.completion_tokens == len(tokens)
        assert final.usage.prompt_tokens == len(WORKLOAD[i][1])
    held = {a.adapter_id for a in generate.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert held <= set(ADAPTERS) and held


def test_an_adapter_registered_from_s3_is_served(generate, admin, sources_root, s3_endpoint, in_process):
    register(admin, "qv4-from-s3", upload_folder(s3_endpoint, sources_root / "qv4", "e2e/qv4"))
    _, ids, max_tokens = WORKLOAD[2]
    tokens, _ = _tokens(generate, _request("qv4-from-s3", ids, max_tokens))
    assert tokens == in_process[2]


def test_unknown_adapter_and_bad_input_get_precise_statuses(generate, registered):
    cases = [
        (_request("no-such-adapter", [5], 4), grpc.StatusCode.NOT_FOUND, "no-such-adapter"),
        (_request("../etc/passwd", [5], 4), grpc.StatusCode.INVALID_ARGUMENT, "adapter id"),
        (_request(None, [5], 4, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (_request(None, [999_999], 4), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
        (pb.GenerateRequest(text="hello"), grpc.StatusCode.INVALID_ARGUMENT, "tokenizer"),
    ]
    for request, code, named in cases:
        with pytest.raises(grpc.RpcError) as e:
            _tokens(generate, request)
        assert e.value.code() == code and named in e.value.details()


def test_request_id_is_echoed_in_final_and_names_the_request_in_the_workers_log(generate, worker, registered):
    """Two calls may carry the same request_id (a label of the caller's): both run, and each Final
    gives it back with the worker's own id, which the worker's log lines about the request use."""
    same = [_request(None, [5, 6], 3), _request("all8", [7, 8], 3)]
    for request in same:
        request.request_id = "caller-7"
    with ThreadPoolExecutor(2) as pool:
        finals = [final for _, final in pool.map(lambda r: _tokens(generate, r), same)]
    assert [f.request_id for f in finals] == ["caller-7", "caller-7"]
    assert (
        all(f.worker_request_id for f in finals)
        and finals[0].worker_request_id != finals[1].worker_request_id
    )

    lost = _request("no-such-adapter", [5], 4)
    lost.request_id = "caller-8\nforged line"
    with pytest.raises(grpc.RpcError):
        _tokens(generate, lost)
    until(lambda: "caller-8" in worker.log.read_text())
    line = next(line for line in worker.log.read_text().splitlines() if "caller-8" in line)
    assert re.search(
        r"request [0-9a-f]{32} \(request_id 'caller-8\\nforged line', adapter 'no-such-adapter'\)", line
    )
    assert "NOT_FOUND" in line


def test_a_repeated_prompt_reports_its_cached_tokens_and_another_adapter_none(generate, registered):
    prompt = list(range(40, 80))  # 40 tokens: 2 full blocks of 16, the last token always computed
    first, final = _tokens(generate, _request("all8", prompt, 4))
    again, cached = _tokens(generate, _request("all8", prompt, 4))
    _, other = _tokens(generate, _request("qv4", prompt, 4))
    assert (final.usage.cached_tokens, cached.usage.cached_tokens, other.usage.cached_tokens) == (0, 32, 0)
    assert again == first
    stats = generate.GetStats(pb.GetStatsRequest())
    assert stats.prefix_cache_hits >= 32 and stats.prefix_cache_queries >= 3 * 40


def test_pinning_in_the_store_preloads_the_adapter_on_the_worker(generate, admin, sources_root, long_model):
    # Content of its own: a digest shared with an adapter left in a device slot would read DEVICE.
    build_peft_adapter(long_model, sources_root / "preloaded", seed=77, **TINY_ADAPTERS["mlp16rs"])
    register(admin, "preloaded", f"file://{sources_root / 'preloaded'}")
    admin.PinAdapter(store_pb.PinAdapterRequest(adapter_id="preloaded"), metadata=AUTH)

    def held():
        adapters = generate.ListAdapters(pb.ListAdaptersRequest()).adapters
        return {a.adapter_id: a for a in adapters}.get("preloaded")

    until(lambda: held() is not None and held().location == pb.ADAPTER_LOCATION_HOST)
    assert held().pinned and held().digest.startswith("sha256:")
    admin.UnpinAdapter(store_pb.UnpinAdapterRequest(adapter_id="preloaded"), metadata=AUTH)
    # unpinned, it may also go at once: it is the least requested adapter the host tier holds
    until(lambda: (adapter := held()) is None or not adapter.pinned)


def test_delete_refuses_new_requests_while_running_ones_finish(generate, admin, sources_root):
    register(admin, "doomed", f"file://{sources_root / 're2'}")
    stream = generate.Generate(_request("doomed", [5, 6], 1500, ignore_eos=True), timeout=60)
    first = next(stream)
    admin.DeleteAdapter(store_pb.DeleteAdapterRequest(adapter_id="doomed"), metadata=AUTH)
    until(lambda: _status(generate, _request("doomed", [5], 2)) == grpc.StatusCode.NOT_FOUND)
    tokens = list(first.delta.token_ids)
    final = None
    for response in stream:
        tokens += response.delta.token_ids
        final = response.final if response.HasField("final") else final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 1500


def _alone(model, folder, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt from an in-process engine that only ever had this adapter."""
    engine = Engine(EngineConfig(model=str(model), kv_cache_tokens=4096, max_model_len=2048))
    engine.add_adapter("x", folder)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out.token_ids for out in engine.generate([Request(p, "x", params) for p in prompts])]


STREAMS, STREAM_TOKENS = [[5, 6, 7, 8], [9, 10, 11, 12]], 600


@pytest.mark.parametrize("change", ["re-register", "delete"])
def test_streams_finish_on_the_content_they_began_with_when_the_store_changes_it(
    tmp_path, long_model, store, admin, sources_root, tiny_adapters, change
):
    """Two 608-position streams in an 800-position KV cache, host memory for no idle adapter: the
    store re-registers or deletes their adapter while they run, then the newer stream is
    preempted, its adapter's old content reloaded by digest from the worker's disk cache, and it
    is computed again: both end with the old content's tokens alone."""
    name = f"versioned-{change}"
    register(admin, name, f"file://{sources_root / 'all8'}")
    new = (
        _alone(long_model, tiny_adapters["llama"]["pattern"], STREAMS[:1], 4)[0]
        if change == "re-register"
        else None
    )
    flags = ("--kv-cache-tokens", "800", "--max-model-len", "640", "--max-cpu-loras", "0")
    worker = WorkerProcess(long_model, store.address, tmp_path / "cache", *flags).start()
    try:
        tokens = _streams_through_a_store_change(worker, admin, name, sources_root, new)
    finally:
        worker.terminate()
    assert worker.wait() == 0
    assert tokens == _alone(long_model, tiny_adapters["llama"]["all8"], STREAMS, STREAM_TOKENS)


def _streams_through_a_store_change(worker, admin, name: str, sources_root, new: list[int] | None):
    """STREAMS on adapter `name`; once they run, it is deleted, and registered anew from
    'pattern' when `new` gives that content's first tokens (seen before the streams go on)."""
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        requests = [_request(name, p, STREAM_TOKENS, ignore_eos=True) for p in STREAMS]
        streams = [stub.Generate(request, timeout=120) for request in requests]
        tokens = [list(next(stream).delta.token_ids) for stream in streams]
        admin.DeleteAdapter(store_pb.DeleteAdapterRequest(adapter_id=name), metadata=AUTH)
        if new is not None:  # the store takes a name's new content once the old is deleted
            register(admin, name, f"file://{sources_root / 'pattern'}")
            until(lambda: _first_tokens(stub, _request(name, STREAMS[0], 4, ignore_eos=True)) == new)
        else:
            until(lambda: _status(stub, _request(name, [5], 2)) == grpc.StatusCode.NOT_FOUND)
        preempted = stub.GetStats(pb.GetStatsRequest()).num_preemptions
        assert preempted == 0, "the change landed after a preemption"
        for stream, got in zip(streams, tokens, strict=True):
            got += [t for response in stream for t in response.delta.token_ids]
        assert stub.GetStats(pb.GetStatsRequest()).num_preemptions > 0
    return tokens


def test_worker_keeps_serving_through_a_store_outage(generate, admin, store, sources_root, in_process):
    register(admin, "late", f"file://{sources_root / 'pattern'}")
    held_adapter, ids, max_tokens = WORKLOAD[1]
    assert _tokens(generate, _request(held_adapter, ids, max_tokens))[0] == in_process[1]
    store.kill()

    assert _tokens(generate, _request(held_adapter, ids, max_tokens))[0] == in_process[1]
    with pytest.raises(grpc.RpcError) as e:
        _tokens(generate, _request("late", [5], 3))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "late" in e.value.details()

    store.start()  # same port and data dir; the module fixture stops it at the end
    until(lambda: _status(generate, _request("late", [5], 3)) == grpc.StatusCode.OK, timeout_s=30)


def test_a_bfloat16_worker_reports_the_stores_digest(tmp_path, long_model, store, admin, registered):
    """Digests name registered content: a bfloat16 worker holding a float32 blob shows the store's
    digest, so following the store does not mistake it for stale content."""
    worker = WorkerProcess(long_model, store.address, tmp_path / "cache", "--dtype", "bfloat16").start()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = inference_grpc.InferenceServiceStub(channel)
            _tokens(stub, _request("qv4", [5, 6], 3))
            held = {a.adapter_id: a.digest for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    finally:
        worker.terminate()
        assert worker.wait() == 0
    assert held["qv4"] == admin.GetAdapter(store_pb.GetAdapterRequest(adapter_id="qv4"), metadata=AUTH).digest


def test_cancel_storm_frees_every_request_block_and_slot(generate, registered):
    rng = random.Random(0)

    def cancel_after(i: int) -> None:
        adapter = [None, *ADAPTERS][i % 5]
        stream = generate.Generate(_request(adapter, [5 + i % 50, 6], 400, ignore_eos=True), timeout=60)
        for _ in zip(range(rng.randrange(0, 20)), stream, strict=False):
            pass
        stream.cancel()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(cancel_after, range(100)))

    def idle():
        s = generate.GetStats(pb.GetStatsRequest())
        return (s.running, s.waiting, s.in_flight, s.kv_blocks_used, s.active_slots) == (0, 0, 0, 0, 0)

    until(idle)
    stats = generate.GetStats(pb.GetStatsRequest())
    aborted = sum(r.count for r in stats.requests if r.outcome == "abort")
    assert aborted >= 90  # a few may finish their 400 tokens first
    assert stats.kv_blocks_total > 0


def test_a_full_worker_refuses_at_once_with_resource_exhausted(tmp_path, long_model, store, registered):
    worker = WorkerProcess(long_model, store.address, tmp_path / "cache", "--max-pending", "2").start()
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        long = [stub.Generate(_request(None, [5, 6], 2000, ignore_eos=True), timeout=60) for _ in range(2)]
        for stream in long:
            next(stream)
        start = time.monotonic()
        assert _status(stub, _request(None, [5], 2)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - start < 1.0
        for stream in long:
            stream.cancel()
        until(lambda: _status(stub, _request(None, [5], 2)) == grpc.StatusCode.OK)
    worker.terminate()
    assert worker.wait() == 0


def test_sigterm_drains_streams_in_flight_and_refuses_new_ones(tmp_path, long_model, store):
    worker = WorkerProcess(long_model, store.address, tmp_path / "cache", "--drain-timeout", "30").start()
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        stream = stub.Generate(_request(None, [5, 6], 800, ignore_eos=True), timeout=60)
        tokens = list(next(stream).delta.token_ids)
        worker.terminate()
        until(lambda: _status(stub, _request(None, [5], 2)) == grpc.StatusCode.UNAVAILABLE)
        final = None
        for response in stream:
            tokens += response.delta.token_ids
            final = response.final if response.HasField("final") else final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 800
    assert worker.wait() == 0


def _first_tokens(stub, request) -> list[int] | None:
    """The request's tokens, or None while its adapter is not registered (between a delete and a
    registration anew, the worker may hear of the one before the other)."""
    try:
        return _tokens(stub, request)[0]
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return None


def _status(stub, request) -> grpc.StatusCode:
    try:
        _tokens(stub, request)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK
