"""No caller stalls the rest: prompts over the byte bound are refused untokenized, tokenizing runs
off the event loop, and a client's request_id is only a label."""

import asyncio
import re
import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from inference_service.engine import Engine, EngineConfig
from inference_service.server import convert
from inference_service.server.admission import Admission
from inference_service.server.prometheus_metrics import WorkerMetrics
from inference_service.server.servicer import InferenceServicer
from shared.errors import InvalidArgument
from shared.grpc_server import ErrorInterceptor
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

MAX_MODEL_LEN = 8


class NeverTokenize:
    """A tokenizer none of whose tokens stands for more than 4 bytes; tokenizing fails the test."""

    max_token_bytes = 4

    def encode(self, text, **kwargs):
        pytest.fail(f"a prompt of {len(text.encode())} bytes over the bound was tokenized")

    def apply_chat_template(self, messages, **kwargs):
        pytest.fail("chat messages over the bound were rendered")


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1), **fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"text": "x" * 33}, "text prompt is 33 bytes; at most 32 bytes"),
        ({"text": "é" * 17}, "text prompt is 34 bytes"),  # 17 characters, 34 UTF-8 bytes
        (
            {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user", content="y" * 29)])},
            "chat input (messages and tools) is 33 bytes",
        ),
        (  # a tool's schema counts, and is not parsed before the bound holds
            {
                "chat": pb.ChatInput(
                    messages=[pb.ChatMessage(role="user", content="hi")],
                    tools=[pb.Tool(name="f", parameters="{" * 27)],
                )
            },
            "chat input (messages and tools) is 34 bytes",
        ),
        (  # and so do the arguments of the calls the conversation holds
            {
                "chat": pb.ChatInput(
                    messages=[
                        pb.ChatMessage(
                            role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments="[" * 22)]
                        )
                    ]
                )
            },
            "chat input (messages and tools) is 33 bytes",
        ),
        (
            {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user")], tools=[pb.Tool(name="f")] * 129)},
            "chat input has 129 tools; at most 128",
        ),
        (
            {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user")] * 9)},
            "chat input has 9 messages; max_model_len is 8",
        ),
        ({"token_ids": pb.TokenIds(ids=[1] * 9)}, "prompt has 9 token ids; max_model_len is 8"),
    ],
    ids=[
        "text",
        "text-utf8",
        "chat",
        "chat-tools",
        "chat-tool-calls",
        "chat-tool-count",
        "chat-count",
        "token-ids",
    ],
)
def test_prompt_over_the_bound_is_refused_without_tokenizing(fields, named):
    with pytest.raises(InvalidArgument, match="^" + re.escape(named)):
        convert.request(_request(**fields), NeverTokenize(), MAX_MODEL_LEN, "w1")


def test_request_id_is_capped_and_never_the_engines_key(tokenizer):
    with pytest.raises(InvalidArgument, match="request_id is 257 characters long; at most 256"):
        convert.request(_request(text="hi", request_id="r" * 257), tokenizer, MAX_MODEL_LEN, "w1")
    request = convert.request(_request(text="hi", request_id="r" * 256), tokenizer, MAX_MODEL_LEN, "w1")
    assert request.request_id == "w1"  # the worker's id keys the engine; the caller's is a label


class BlockingTokenizer:
    """The real tokenizer, whose encode waits until the test lets it go."""

    def __init__(self, inner):
        self._inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text, **kwargs):
        self.entered.set()
        if not self.release.wait(timeout=10):
            raise AssertionError("encode was never let go: it blocked the event loop the test runs on")
        return self._inner.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    engine = Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=512))
    engine.start()
    yield engine
    engine.stop()


async def _served(engine: Engine, scenario) -> None:
    """Runs `scenario(stub)` against the real servicer on an in-process server on this event loop."""
    admission = Admission(8)
    servicer = InferenceServicer(admission, WorkerMetrics(CollectorRegistry(), admission))
    servicer.engine = engine
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await scenario(pb_grpc.InferenceServiceStub(channel))
    finally:
        await server.stop(None)


def test_tokenizing_never_runs_on_the_event_loop(engine, monkeypatch):
    tokenizer = BlockingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", tokenizer)

    async def scenario(stub):
        call = stub.Generate(_request(text="a legal prompt " * 20), timeout=30)
        responses = asyncio.ensure_future(_collect(call))
        assert await asyncio.to_thread(tokenizer.entered.wait, 10), "the prompt was never tokenized"
        # encode is blocked now; had it run on the event loop, nothing below could run.
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=5)
        tokenizer.release.set()
        final = (await responses)[-1].final
        assert stats.in_flight == 1 and final.usage.completion_tokens == 1

    asyncio.run(_served(engine, scenario))


def test_two_callers_with_one_request_id_are_both_served(engine):
    async def scenario(stub):
        same = [_request(text="same id", request_id="mine") for _ in range(2)]
        results = await asyncio.gather(*(_collect(stub.Generate(r, timeout=30)) for r in same))
        assert [r[-1].final.finish_reason for r in results] == [pb.FINISH_REASON_LENGTH] * 2

    asyncio.run(_served(engine, scenario))


async def _collect(call) -> list[pb.GenerateResponse]:
    return [response async for response in call]


@pytest.mark.parametrize(
    ("chat", "named"),
    [
        (  # nested past Python's recursion limit: json.loads raises RecursionError, not ValueError
            pb.ChatInput(
                messages=[
                    pb.ChatMessage(
                        role="assistant",
                        tool_calls=[pb.ToolCall(id="c", name="f", arguments="[" * 5000 + "]" * 5000)],
                    )
                ]
            ),
            "chat.messages[0].tool_calls[0].arguments is not JSON",
        ),
        (
            pb.ChatInput(
                messages=[pb.ChatMessage(role="user", content="hi")],
                tools=[pb.Tool(name="f", parameters="[1]")],
            ),
            "chat.tools[0].parameters is not a JSON object",
        ),
    ],
    ids=["nested-arguments", "parameters-not-an-object"],
)
def test_tool_json_that_is_no_object_is_refused_naming_it(tokenizer, chat, named):
    with pytest.raises(InvalidArgument, match="^" + re.escape(named)):
        convert.request(_request(chat=chat), tokenizer, 1 << 16, "w1")
