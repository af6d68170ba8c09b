"""The adapter of every Generate call rides along as `x-loramux-adapter` metadata, the key nginx
routes by (deploy/nginx/loramux.conf), as a real gRPC server on loopback receives it."""

import asyncio
from concurrent import futures

import grpc
import pytest

import loramux
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc


class RecordingWorker(inference_grpc.InferenceServiceServicer):
    """Answers every Generate with one finished message and keeps the metadata it came with."""

    def __init__(self):
        self.seen: list[dict[str, str]] = []

    def Generate(self, request, context):
        self.seen.append(dict(context.invocation_metadata()))
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH))


@pytest.fixture(scope="module")
def recording():
    """(address, RecordingWorker) of a real gRPC server on a free loopback port."""
    worker = RecordingWorker()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    inference_grpc.add_InferenceServiceServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", worker
    server.stop(None)


def test_generate_sends_the_adapter_name_and_the_token(recording):
    address, worker = recording
    with loramux.Client(worker=address, api_token="t0k", timeout=10) as client:
        client.complete(token_ids=[1, 2], adapter="legal-v2")
    assert worker.seen[-1]["x-loramux-adapter"] == "legal-v2"
    assert worker.seen[-1]["authorization"] == "Bearer t0k"


def test_the_async_client_sends_it_too(recording):
    address, worker = recording

    async def run():
        async with loramux.AsyncClient(worker=address, timeout=10) as client:
            await client.complete(token_ids=[1, 2], adapter="medical.7")

    asyncio.run(run())
    assert worker.seen[-1]["x-loramux-adapter"] == "medical.7"


@pytest.mark.parametrize("adapter", [None, ""])
def test_base_model_calls_carry_no_adapter_key(recording, adapter):
    address, worker = recording
    with loramux.Client(worker=address, timeout=10) as client:
        client.complete(token_ids=[1, 2], adapter=adapter)
    assert "x-loramux-adapter" not in worker.seen[-1]


def test_a_name_metadata_cannot_carry_still_reaches_the_worker(recording):
    """The worker, not gRPC's metadata check, is the one to refuse a malformed name."""
    address, worker = recording
    with loramux.Client(worker=address, timeout=10) as client:
        client.complete(token_ids=[1, 2], adapter="légal\n")
    assert "x-loramux-adapter" not in worker.seen[-1]
