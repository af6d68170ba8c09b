"""Generated bodies at both completion endpoints: wrong types, values out of range, unknown keys,
tools and response formats of random schemas, and bytes that are no JSON at all. Whatever the
body, the answer is never a 5xx and every refusal is in OpenAI's error shape. The app runs in this
process (a round trip per example stays cheap) against a real worker whose short context keeps
every generation that does start short."""

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from openai_gateway.app import create_app
from openai_gateway.config import GatewayConfig
from tests.e2e.conftest import WorkerProcess, free_port

BASE = "base"  # the served model name
PATHS = ["/v1/completions", "/v1/chat/completions"]
UNKNOWN = "frobnicate"  # a key neither endpoint takes
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
PAST_INT32 = st.sampled_from([-1, 2**31, 2**40, 2**63, 2**64, 2**70, -(2**70)]) | st.integers(min_value=2**31)
ANY = JSON | PAST_INT32
# A count no generation can run long on: 1..3, or one the gateway or worker refuses at once.
NOT_A_COUNT = (
    PAST_INT32 | st.integers(max_value=0) | JSON.filter(lambda v: not isinstance(v, int | float | None))
)
TEXT = st.text(max_size=20)
TOKEN_IDS = st.lists(st.integers(0, 300), min_size=1, max_size=6)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": TEXT | st.lists(PART)}
)
NOT_A_MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "name", "type"]), ANY | TEXT, max_size=3)
# JSON schemas a client may send: nested objects, arrays and alternatives, or any JSON at all.
SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    lambda inner: (
        st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.dictionaries(st.text(max_size=5), inner, max_size=3),
            },
            optional={
                "required": st.lists(st.text(max_size=5), max_size=2),
                "additionalProperties": st.booleans(),
            },
        )
        | st.fixed_dictionaries({"type": st.just("array"), "items": inner})
        | st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)})
    ),
    max_leaves=6,
)
TOOLS = st.lists(st.tuples(SCHEMA | JSON, st.booleans() | st.none()), max_size=4).map(
    lambda tools: [
        {"type": "function", "function": {"name": f"f{i}", "parameters": schema, "strict": strict}}
        for i, (schema, strict) in enumerate(tools)
    ]
)
TOOL_CHOICE = st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f0"}}])
RESPONSE_FORMAT = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | SCHEMA.map(
    lambda schema: {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
)

# field: (a valid value, so later checks and generation run too; anything a client could send)
SHARED = {
    "model": (st.sampled_from([BASE, "all8"]), ANY | TEXT),
    "max_tokens": (st.integers(1, 3), NOT_A_COUNT),
    "max_completion_tokens": (st.integers(1, 3), NOT_A_COUNT),
    "n": (st.integers(1, 3), NOT_A_COUNT | st.integers(17, 40)),
    "temperature": (st.floats(0, 2), ANY),
    "top_p": (st.floats(0.01, 1), ANY),
    "seed": (st.integers(0, 2**64 - 1), ANY),
    "stop": (st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3), ANY),
    "stream": (st.booleans(), ANY),
    "stream_options": (st.none(), ANY),
    "user": (TEXT, ANY),
    "top_k": (st.integers(0, 50), ANY),
    "min_p": (st.floats(0, 1), ANY),
    "repetition_penalty": (st.floats(0.5, 2), ANY),
    "ignore_eos": (st.booleans(), ANY),
    "stop_token_ids": (st.lists(st.integers(0, 300), max_size=4), ANY | st.lists(ANY, max_size=3)),
    "presence_penalty": (st.floats(-2, 2), ANY),
    "frequency_penalty": (st.floats(-2, 2), ANY),
    "logit_bias": (st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=4), ANY),
    UNKNOWN: (st.nothing(), ANY),  # only ever hostile
}
FIELDS = {
    "/v1/completions": SHARED
    | {
        "prompt": (
            TEXT | TOKEN_IDS | st.lists(TEXT | TOKEN_IDS, min_size=1, max_size=3),
            ANY | st.lists(ANY, max_size=3) | st.lists(st.lists(ANY, max_size=3), max_size=2),
        ),
        "logprobs": (st.integers(0, 5), ANY),
        "best_of": (st.none(), ANY),
    },
    "/v1/chat/completions": SHARED
    | {
        "messages": (st.lists(MESSAGE, min_size=1, max_size=3), ANY | st.lists(NOT_A_MESSAGE, max_size=2)),
        "logprobs": (st.booleans(), ANY),
        "top_logprobs": (st.none(), ANY),
        "tools": (TOOLS, ANY | st.lists(ANY, max_size=2)),
        "tool_choice": (TOOL_CHOICE, ANY),
        "parallel_tool_calls": (st.booleans(), ANY),
        "response_format": (RESPONSE_FORMAT, ANY),
    },
}
REQUIRED = {"model", "max_tokens", "prompt", "messages"}  # max_tokens: unset would run to the context
NOT_A_REQUEST = st.one_of(  # no JSON, JSON that is no object, or JSON past what the parser takes
    st.binary(max_size=40),
    st.integers(1, 30_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(4_000, 6_000).map(lambda digits: b'{"model": "base", "prompt": [' + b"7" * digits + b"]}"),
    st.sampled_from([b'{"model": "\\ud800"}', b'{"model": "base", "prompt": "\\udfff"}', b"[1, 2]", b""]),
)


@st.composite
def bodies(draw, path: str) -> bytes:
    """A body with up to three hostile fields; every other field valid (optional ones maybe unset)."""
    fields = FIELDS[path]
    hostile = draw(st.sets(st.sampled_from(sorted(fields)), max_size=3))
    optional = draw(st.sets(st.sampled_from(sorted(fields.keys() - {UNKNOWN}))))
    chosen = hostile | (REQUIRED & fields.keys()) | optional
    event(f"hostile: {', '.join(sorted(hostile)) or 'none'}")
    body = {name: draw(fields[name][name in hostile]) for name in sorted(chosen)}
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def fuzz_worker(tmp_path_factory, chat_model):
    """The base model alone (adapters are unknown to it: 404) with a 128-token context."""
    cache = tmp_path_factory.mktemp("fuzz-worker") / "cache"
    process = WorkerProcess(chat_model, None, cache, "--max-model-len", "128").start()
    yield process
    process.terminate()
    assert process.wait() == 0


@pytest.fixture(scope="module")
def in_process(fuzz_worker) -> TestClient:
    """The gateway's app, run in this process by TestClient; the completion routes never reach a store."""
    config = GatewayConfig(
        worker=fuzz_worker.address,
        store=f"127.0.0.1:{free_port()}",
        served_model_name=BASE,
        max_body_bytes=65536,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        yield client


def assert_answered(reply) -> None:
    """Never a 5xx; a refusal in OpenAI's shape; a stream that started carries no server error."""
    assert reply.status_code < 500, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] is None or isinstance(error["param"], str), error
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in reply.text, reply.text[-300:]
    event(f"status {reply.status_code}")


@pytest.mark.parametrize("path", PATHS)
@FUZZ
@given(data=st.data())
def test_generated_bodies_are_answered_without_a_5xx(in_process, path, data):
    assert_answered(in_process.post(path, content=data.draw(bodies(path))))


@pytest.mark.parametrize("path", PATHS)
@FUZZ
@given(body=NOT_A_REQUEST)
def test_bytes_that_are_no_request_are_400(in_process, path, body):
    reply = in_process.post(path, content=body)
    assert_answered(reply)
    assert reply.status_code == 400


def test_the_app_serves_after_the_generated_bodies(in_process):  # runs after them, in file order
    reply = in_process.post(
        "/v1/chat/completions",
        json={"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
