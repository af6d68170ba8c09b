"""A worker process whose engine fails mid-run, by an exception or by a step that never returns:
its streams end with UNAVAILABLE at once (within the step timeout for a hung step), health turns
NOT_SERVING and the process exits non-zero for its supervisor to restart it."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.adapter_store.conftest import spawn
from tests.e2e.conftest import wait_ready
from tests.e2e.faulty_worker import FAULT, HANGING
from tests.prometheus_scrape import logged_metrics_address, scrape, value

STREAMS = 3
STEP_TIMEOUT_S = 2.0


def _stream(stub, prompt: list[int], out: dict) -> None:
    """Generate until the stream ends; records when the last delta came and how it ended."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    out["last_message"] = time.monotonic()
    try:
        for _ in stub.Generate(request, timeout=60):
            out["last_message"] = time.monotonic()
    except grpc.RpcError as e:
        out["ended"], out["code"], out["details"] = time.monotonic(), e.code(), e.details()


def _watch(health, statuses: list) -> None:
    try:
        for response in health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=60):
            statuses.append(response.status)
    except grpc.RpcError:
        statuses.append("closed")


# (fault, what the streams' status names, how long after their last message they may end)
FAULTS = [("raise", FAULT, 1.0), ("hang", f"a step ran past {STEP_TIMEOUT_S:g} s", STEP_TIMEOUT_S + 1.5)]


@pytest.mark.parametrize(("fault", "named", "within_s"), FAULTS, ids=[f[0] for f in FAULTS])
def test_an_engine_fault_ends_every_stream_with_unavailable_and_the_worker_exits_1(
    tiny_models, tmp_path, fault, named, within_s
):
    env = {"LORAMUX_FAULT": fault, "LORAMUX_FAULT_AFTER_STEPS": "40", "LORAMUX_CACHE": str(tmp_path)}
    args = ["--listen", "127.0.0.1:0", "--model", str(tiny_models["llama"])]
    args += ["--step-timeout", str(STEP_TIMEOUT_S)]
    process, address = spawn("tests.e2e.faulty_worker", args, env, tmp_path / "worker.log")
    with grpc.insecure_channel(address) as channel:
        statuses: list = []
        watcher = threading.Thread(target=_watch, args=(health_pb2_grpc.HealthStub(channel), statuses))
        watcher.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 60
        while serving not in statuses and time.monotonic() < deadline:
            time.sleep(0.05)
        stub = inference_grpc.InferenceServiceStub(channel)
        results = [{} for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=_stream, args=(stub, [5 + i, 6, 7], results[i])) for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        watcher.join(timeout=30)
    assert process.wait(timeout=30) == 1
    for r in results:
        assert r["code"] == grpc.StatusCode.UNAVAILABLE, r
        assert "engine failed" in r["details"] and named in r["details"]
        assert r["ended"] - r["last_message"] < within_s  # no stream waits on a dead engine
    after_ready = statuses[statuses.index(serving) :]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in after_ready, statuses
    assert ("Traceback" if fault == "raise" else "giving up on the engine") in (
        tmp_path / "worker.log"
    ).read_text()


def test_stats_metrics_and_adapter_listings_answer_while_a_step_hangs(tiny_models, tmp_path):
    """They read what the last step published, so a step that runs long (a hung device here, a
    CPU shared with other workers in practice) delays none of them; the old ones waited for the
    step's lock, past any scrape timeout."""
    log = tmp_path / "worker.log"
    env = {"LORAMUX_FAULT": "hang", "LORAMUX_FAULT_AFTER_STEPS": "0", "LORAMUX_CACHE": str(tmp_path)}
    args = ["--listen", "127.0.0.1:0", "--model", str(tiny_models["llama"]), "--step-timeout", "600"]
    process, address = spawn("tests.e2e.faulty_worker", [*args, "--metrics-listen", "127.0.0.1:0"], env, log)
    try:
        metrics = logged_metrics_address(log)
        wait_ready(address, log)  # a Generate sent while the model loads is refused, not hung
        with grpc.insecure_channel(address) as channel:
            stub = inference_grpc.InferenceServiceStub(channel)
            stream = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7])), timeout=60)
            deadline = time.monotonic() + 30
            while HANGING not in log.read_text():  # the stream's first step holds the engine now
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)

            stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
            assert stub.ListAdapters(pb.ListAdaptersRequest(), timeout=5).adapters == []
            samples = scrape(metrics)  # urllib's timeout: 10 s, Prometheus' default scrape timeout
            assert stats.in_flight == 1
            assert value(samples, "loramux:generate_calls_in_flight") == 1
            stream.cancel()
    finally:
        process.kill()
        process.wait(timeout=30)
