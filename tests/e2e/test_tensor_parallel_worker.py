"""A worker over two tensor-parallel ranks (`--tensor-parallel-size 2`), fetching adapters from a
real store: it serves mixed adapters as the in-process engine on one device does, says how it is
split, and when a rank dies its streams end UNAVAILABLE, it exits non-zero and leaves no process."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.e2e.conftest import WorkerProcess
from tests.e2e.test_worker_e2e import WORKLOAD, _request, _tokens, in_process, registered  # noqa: F401


@pytest.fixture(scope="module")
def ranked_worker(tmp_path_factory, long_model, store):
    flags = (
        "--tensor-parallel-size",
        "2",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--kv-cache-tokens",
        "4096",
    )
    process = WorkerProcess(
        long_model, store.address, tmp_path_factory.mktemp("tp") / "cache", *flags
    ).start()
    yield process
    if process.process.poll() is None:
        process.terminate()
        assert process.wait() == 0


def test_two_ranks_serve_mixed_adapters_as_one_device_does(ranked_worker, registered, in_process):  # noqa: F811
    with grpc.insecure_channel(ranked_worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        with ThreadPoolExecutor(len(WORKLOAD)) as pool:
            results = list(pool.map(lambda w: _tokens(stub, _request(*w)), WORKLOAD))
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
    for i, (tokens, _) in enumerate(results):
        assert tokens == in_process[i], f"request {i} ({WORKLOAD[i][0]})"
    assert info.tensor_parallel_size == 2


def test_a_rank_killed_ends_its_streams_unavailable_and_the_worker_exits_leaving_no_process(
    tmp_path,
    long_model,
    store,
    registered,  # noqa: F811
):
    worker = WorkerProcess(
        long_model, store.address, tmp_path / "cache", "--tensor-parallel-size", "2"
    ).start()
    (rank,) = _children(worker.process.pid)
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        stream = stub.Generate(_request("all8", [5, 6], 3000, ignore_eos=True), timeout=60)
        next(stream)
        killed = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - killed < 10
    assert worker.wait() != 0
    assert not _children(worker.process.pid) and not Path(f"/proc/{rank}").exists()


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for task in Path(f"/proc/{pid}/task").glob("*")
        for p in (task / "children").read_text().split()
    ]
