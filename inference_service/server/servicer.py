"""The InferenceService gRPC servicer: each method decodes, calls the engine, encodes."""

import asyncio
import time

from inference_service.engine import Engine
from inference_service.server import convert
from inference_service.server.admission import Admission
from shared.errors import Unavailable
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, admission: Admission):
        self.admission = admission
        self.engine: Engine | None = None  # set once the model is loaded: readiness

    def _ready_engine(self) -> Engine:
        if self.engine is None:
            raise Unavailable("the worker is still loading its model; retry shortly")
        return self.engine

    async def Generate(self, request, context):
        with self.admission.enter():  # before tokenizing: an overloaded worker refuses at once
            engine = self._ready_engine()
            start = time.perf_counter()
            first_token_s = None
            # Tokenizing and templating take time in proportion to the prompt: in a thread, so the
            # event loop goes on serving every other call meanwhile.
            engine_request = await asyncio.to_thread(
                convert.request, request, engine.tokenizer, engine.max_model_len
            )
            async for delta in engine.stream(engine_request):
                if delta.error is not None:
                    raise delta.error
                if delta.token_ids and first_token_s is None:
                    first_token_s = time.perf_counter() - start
                if delta.token_ids or delta.text:
                    yield convert.delta(delta)
                if delta.finish_reason is not None:
                    total_s = time.perf_counter() - start
                    yield convert.final(delta, first_token_s or total_s, total_s)

    # Snapshots take the engine's step lock: they wait in a thread, never on the event loop.
    async def ListAdapters(self, request, context):
        return convert.adapters(await asyncio.to_thread(self._ready_engine().adapter_states))

    async def GetModelInfo(self, request, context):
        return convert.model_info(self._ready_engine())

    async def GetStats(self, request, context):
        snapshot = await asyncio.to_thread(self._ready_engine().stats)
        return convert.stats(snapshot, self.admission.in_flight)
