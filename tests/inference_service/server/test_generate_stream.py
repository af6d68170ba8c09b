"""Generate's stream: what the engine joined into one delta goes out as one message, every token
of it, and an error after tokens reaches the client after them."""

import asyncio

from prometheus_client import CollectorRegistry

from inference_service.engine import Delta, EngineConfig
from inference_service.server.admission import Admission
from inference_service.server.prometheus_metrics import WorkerMetrics
from inference_service.server.servicer import InferenceServicer
from shared.errors import FailedPrecondition
from shared.pb.loramux.inference.v1 import inference_pb2 as pb


class ScriptedEngine:
    """What the servicer asks of Engine, with `stream` yielding the given deltas."""

    tokenizer = None
    max_model_len = 64
    config = EngineConfig(model="scripted")

    def __init__(self, deltas: list[Delta]):
        self.deltas = deltas

    async def stream(self, request):
        for delta in self.deltas:
            yield delta


def _messages(deltas: list[Delta]) -> tuple[list[pb.GenerateResponse], Exception | None, WorkerMetrics]:
    admission = Admission(4)
    metrics = WorkerMetrics(CollectorRegistry(), admission)
    servicer = InferenceServicer(admission, metrics)
    servicer.engine = ScriptedEngine(deltas)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=8))

    async def collect():
        out = []
        try:
            async for message in servicer.Generate(request, None):
                out.append(message)
        except Exception as e:
            return out, e
        return out, None

    return (*asyncio.run(collect()), metrics)


def _itl_count(metrics: WorkerMetrics) -> float:
    return metrics.registry.get_sample_value("loramux:inter_token_latency_seconds_count")


def test_a_joined_delta_is_one_message_and_counts_a_latency_for_each_token():
    deltas = [Delta("r", [5], "a"), Delta("r", [6, 7, 8], "bcd", finish_reason="length", completion_tokens=4)]
    messages, error, metrics = _messages(deltas)
    assert error is None
    assert [list(m.delta.token_ids) for m in messages[:2]] == [[5], [6, 7, 8]]
    assert messages[1].delta.text == "bcd" and messages[2].final.usage.completion_tokens == 4
    assert _itl_count(metrics) == 3  # the 3 tokens after the first: one measured gap, two of 0


def test_tokens_joined_with_an_error_go_out_before_it():
    error = FailedPrecondition("adapter 'x' produced NaN or Inf logits for this request")
    messages, raised, _ = _messages([Delta("r", [5, 6], "ab", finish_reason="error", error=error)])
    assert [list(m.delta.token_ids) for m in messages] == [[5, 6]]
    assert raised is error
