"""A stand-in InferenceService for the SDK's Generate path until the real worker can run in tests:
it answers over real gRPC, so what it records is what the SDK put on the wire."""

import threading
import time

import grpc

from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

API_TOKEN = "worker-token"
SLOW, FAILING, MISSING = "slow", "fails-midway", "missing"  # adapters that change the answer


class FakeWorker(pb_grpc.InferenceServiceServicer):
    """Generate repeats the prompt's words, one per delta, max_tokens of them (token id = position),
    and stops early before a word that is one of the stop strings.
    Adapter SLOW waits between deltas, FAILING ends with RESOURCE_EXHAUSTED after two deltas,
    MISSING is NOT_FOUND. Generate needs the bearer API_TOKEN."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.cut_short: dict[str, threading.Event] = {}  # request_id -> set if the call ended early

    def Generate(self, request, context):
        self.requests.append(request)
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {API_TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "Generate needs a bearer token")
        if request.adapter == MISSING:
            context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.adapter!r} is not registered")
        cut_short, sent_all = self.cut_short.setdefault(request.request_id, threading.Event()), False
        context.add_callback(lambda: sent_all or cut_short.set())  # runs when the call ends, however
        words = _words(request)
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        finish = pb.FINISH_REASON_LENGTH
        for i in range(n):
            word = words[i % len(words)]
            if word in request.sampling.stop:
                finish, n = pb.FINISH_REASON_STOP, i
                break
            if request.adapter == FAILING and i == 2:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue is full")
            if request.adapter == SLOW:
                time.sleep(0.02)
            yield pb.GenerateResponse(delta=pb.Delta(token_ids=[i], text=word + " "))
        usage = pb.Usage(prompt_tokens=len(words), completion_tokens=n)
        timings = pb.Timings(time_to_first_token_s=0.01, total_s=0.02)
        final = pb.Final(finish_reason=finish, usage=usage, timings=timings)
        yield pb.GenerateResponse(final=final)
        sent_all = True

    def ListAdapters(self, request, context):
        return pb.ListAdaptersResponse(
            adapters=[
                pb.WorkerAdapter(adapter_id="a1", digest="sha256:ab", location=pb.ADAPTER_LOCATION_DEVICE),
                pb.WorkerAdapter(adapter_id="a2", location=pb.ADAPTER_LOCATION_LOADING, pinned=True),
            ]
        )

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model_name="tiny", model_type="llama", vocab_size=160, eos_token_ids=[2])


def _words(request: pb.GenerateRequest) -> list[str]:
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text.split()
    if kind == "chat":
        return [f"{m.role}:{m.content}" for m in request.chat.messages]
    return [str(t) for t in request.token_ids.ids]
