"""The InferenceService gRPC servicer: each method decodes, calls the engine, encodes."""

import asyncio
import uuid

from inference_service.engine import Engine
from inference_service.server import convert
from inference_service.server.admission import Admission
from inference_service.server.prometheus_metrics import WorkerMetrics
from inference_service.server.request_log import CancelLog, request_log
from shared.errors import Unavailable
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, admission: Admission, metrics: WorkerMetrics):
        self.admission, self.metrics = admission, metrics
        self.engine: Engine | None = None  # set once the model is loaded: readiness
        self.cancels = CancelLog()

    def _ready_engine(self) -> Engine:
        if self.engine is None:
            raise Unavailable("the worker is still loading its model; retry shortly")
        return self.engine

    async def Generate(self, request, context):
        worker_request_id = uuid.uuid4().hex
        # Admission before tokenizing: an overloaded worker refuses at once (and that is counted).
        with (
            self.metrics.generate_call(request.adapter) as call,
            request_log(worker_request_id, request.request_id, request.adapter, self.cancels),
            self.admission.enter(),
        ):
            engine = self._ready_engine()
            # Tokenizing and templating take time in proportion to the prompt: in a thread, so the
            # event loop goes on serving every other call meanwhile.
            engine_request = await asyncio.to_thread(
                convert.request,
                request,
                engine.tokenizer,
                engine.max_model_len,
                worker_request_id,
                engine.config.constrain_reasoning,
            )
            async for delta in engine.stream(engine_request):
                if delta.token_ids:
                    call.tokens(len(delta.token_ids))
                if delta.token_ids or delta.text:
                    yield convert.delta(delta, engine.tokenizer)
                if delta.error is not None:
                    raise delta.error
                if delta.finish_reason is not None:
                    yield convert.final(delta, request.request_id, *call.finished())

    # These read what the engine published after its last step: they never wait for a step.
    async def ListAdapters(self, request, context):
        return convert.adapters(self._ready_engine().adapter_states())

    async def GetModelInfo(self, request, context):
        return convert.model_info(self._ready_engine())

    async def GetStats(self, request, context):
        return convert.stats(self._ready_engine().stats(), self.admission.in_flight)
