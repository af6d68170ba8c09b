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

from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from shared.model_config import ModelConfig
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


def test_each_rank_holds_half_the_weights_and_its_kv_heads(ranked_worker, long_model):
    """Everything is split but the norms and the rotary frequencies (every rank holds them
    whole): each rank holds half the model's weights plus those, and half the KV cache a
    one-device worker's cache of as many positions takes."""
    with grpc.insecure_channel(ranked_worker.address) as channel:
        stats = inference_grpc.InferenceServiceStub(channel).GetStats(pb.GetStatsRequest())
    one = ModelRunner(EngineConfig(model=str(long_model), kv_cache_tokens=4096)).memory_report()
    cfg = ModelConfig.from_dir(long_model)
    whole = ((2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.head_dim // 2) * 4  # float32
    assert [r.rank for r in stats.ranks] == [0, 1]
    for rank in stats.ranks:
        assert rank.weight_bytes == (one["weight_bytes"] - whole) // 2 + whole
        assert rank.kv_cache_bytes == one["kv_cache_bytes"] // 2
    assert stats.collective_seconds > 0


def test_a_rank_killed_ends_its_streams_unavailable_and_the_worker_exits_leaving_no_process(
    tmp_path,
    long_model,
    store,
    registered,  # noqa: F811
):
    worker, rank = _two_rank_worker(tmp_path, long_model, store)
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


def _two_rank_worker(tmp_path, long_model, store) -> tuple[WorkerProcess, int]:
    """A worker over 2 ranks, and the process id of its rank 1."""
    flags = ("--tensor-parallel-size", "2")
    worker = WorkerProcess(long_model, store.address, tmp_path / "cache", *flags).start()
    (rank,) = _children(worker.process.pid)
    return worker, rank


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for task in Path(f"/proc/{pid}/task").glob("*")
        for p in (task / "children").read_text().split()
    ]


def test_sigterm_drains_the_streams_then_stops_every_rank(tmp_path, long_model, store):
    worker, rank = _two_rank_worker(tmp_path, long_model, store)
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        stream = stub.Generate(_request(None, [5, 6], 400, ignore_eos=True), timeout=60)
        tokens = list(next(stream).delta.token_ids)
        worker.terminate()
        for response in stream:
            tokens += response.delta.token_ids
    assert len(tokens) == 400
    assert worker.wait() == 0
    assert not Path(f"/proc/{rank}").exists()
