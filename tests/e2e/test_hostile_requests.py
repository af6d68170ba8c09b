"""A live worker against whatever a client can send: every GenerateRequest field (an output
constraint among them) fuzzed at extreme values and sizes gets a precise status (never INTERNAL
or UNKNOWN) and the worker keeps serving; a request longer than max_model_len (which the KV cache
is sized to hold) is refused at once, the others unaffected."""

import threading

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inference_service.sampling import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRUCTURED_CHARS,
)
from inference_service.server.convert import OPTIONAL_SAMPLING
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.deep_constraints import DEEP, deepest
from tests.e2e.conftest import WorkerProcess

MAX_MODEL_LEN = 128  # the KV cache holds one such request and no more
MAX_MESSAGE_BYTES = 4 << 20
CLIENT_MISTAKES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 2**31 - 1, -(2**31)]))
FLOATS = st.floats(width=32)  # NaN, ±inf, subnormals and extremes included
HOSTILE_TEXT = ["", "\n", "\x00", "name\n", "<|im_start|>", "<|im_end|>\x00", "🚀" * 50, "\ufffd"]
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(HOSTILE_TEXT))


@pytest.fixture(scope="module")
def worker(tmp_path_factory, tiny_chat_model):
    process = WorkerProcess(
        tiny_chat_model,
        None,
        tmp_path_factory.mktemp("hostile-worker") / "cache",
        *("--kv-cache-tokens", str(MAX_MODEL_LEN), "--max-model-len", str(MAX_MODEL_LEN)),
        *("--max-message-bytes", str(MAX_MESSAGE_BYTES)),
    ).start()
    yield process
    process.terminate()
    assert process.wait() == 0


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield pb_grpc.InferenceServiceStub(ch)


def generate(stub, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    responses = []
    try:
        responses.extend(stub.Generate(request, timeout=30))
    except grpc.RpcError as e:
        return e.code(), e.details(), responses
    return grpc.StatusCode.OK, "", responses


def _chat(messages) -> dict:
    return {"chat": pb.ChatInput(messages=messages)}


ROLES = st.sampled_from(["system", "user", "assistant"])
SANE_INPUT = st.one_of(
    st.builds(dict, text=st.text(min_size=1, max_size=200)),
    st.builds(
        dict, token_ids=st.builds(pb.TokenIds, ids=st.lists(st.integers(0, 49151), min_size=1, max_size=50))
    ),
    st.lists(st.builds(pb.ChatMessage, role=ROLES, content=st.text(max_size=60)), min_size=1, max_size=4).map(
        _chat
    ),
)
HOSTILE_INPUT = st.one_of(
    st.just({}),
    st.builds(dict, text=st.one_of(TEXT, st.integers(0, 200_000).map(lambda n: "é" * n))),
    st.builds(dict, token_ids=st.builds(pb.TokenIds, ids=st.lists(INT32, max_size=300))),
    st.just({"token_ids": pb.TokenIds(ids=[1] * 100_000)}),
    st.lists(st.builds(pb.ChatMessage, role=TEXT, content=TEXT), max_size=5).map(_chat),
    st.just(_chat([pb.ChatMessage(role="user", content="hi")] * 10_000)),
)
TEXT_KINDS = st.sampled_from(["json_schema", "regex", "grammar"])
SANE_STRUCTURED = st.sampled_from(
    [{}, {"regex": "[a-z]{1,6}"}, {"json_object": True}, {"choice": pb.Choices(choices=["yes", "no"])}]
)
HOSTILE_STRUCTURED = st.one_of(
    st.builds(lambda kind, text: {kind: text}, TEXT_KINDS, TEXT),
    st.builds(lambda kind: {kind: "x" * (MAX_STRUCTURED_CHARS + 1)}, TEXT_KINDS),
    st.sampled_from([{kind: deepest(build)} for kind, build in DEEP.values()]),
    st.sampled_from([{"json_object": False}, {"choice": pb.Choices(choices=["a"] * (MAX_CHOICES + 1))}]),
    st.lists(TEXT, max_size=4).map(lambda choices: {"choice": pb.Choices(choices=choices)}),
)
# field: (a valid value, so later checks and generation run too; anything a client could send)
FIELDS = {
    "request_id": (st.text(max_size=20), st.one_of(TEXT, st.integers(250, 300).map(lambda n: "r" * n))),
    "adapter": (st.just(""), st.one_of(st.sampled_from(["ghost", "name\n", "../x", "a" * 129]), TEXT)),
    "input": (SANE_INPUT, HOSTILE_INPUT),
    "max_tokens": (st.integers(1, 40), INT32),
    "min_tokens": (st.integers(0, 4), INT32),
    "temperature": (st.floats(0, 2), FLOATS),
    "top_k": (st.integers(0, 100), INT32),
    "top_p": (st.floats(0.01, 1), FLOATS),
    "min_p": (st.floats(0, 1), FLOATS),
    "repetition_penalty": (st.floats(0.5, 2), FLOATS),
    "presence_penalty": (st.floats(-2, 2), FLOATS),
    "frequency_penalty": (st.floats(-2, 2), FLOATS),
    "logit_bias": (
        st.dictionaries(st.integers(0, 255), st.floats(-100, 100, width=32), max_size=4),
        st.dictionaries(INT32, FLOATS, max_size=4) | st.just({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ),
    "seed": (st.integers(0, 2**64 - 1), st.sampled_from([0, 2**64 - 1])),
    "stop": (
        st.lists(st.text(min_size=1, max_size=8), max_size=4),
        st.one_of(
            st.lists(TEXT, max_size=MAX_STOP_STRINGS + 2),
            st.sampled_from([["a"] * 10_000, ["x" * (1 << 20)], ["y" * (MAX_STOP_CHARS + 1)]]),
        ),
    ),
    "stop_token_ids": (st.lists(st.integers(0, 60_000), max_size=8), st.lists(INT32, max_size=70)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "logprobs": (st.integers(0, 20), INT32),
    "structured": (SANE_STRUCTURED, HOSTILE_STRUCTURED),  # one of SamplingParams' oneof fields
}
OPTIONAL = set(OPTIONAL_SAMPLING)  # the fields the worker reads only where they are set


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A request with up to three hostile fields; every other field valid (optional ones maybe unset)."""
    hostile = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=3))
    value = {name: draw(FIELDS[name][name in hostile]) for name in FIELDS}
    unset = draw(st.sets(st.sampled_from(sorted(OPTIONAL - hostile))))
    sampling = {
        k: v for k, v in value.items() if k not in {"request_id", "adapter", "input", "structured", *unset}
    }
    event(f"hostile: {', '.join(sorted(hostile)) or 'none'}")
    return pb.GenerateRequest(
        request_id=value["request_id"],
        adapter=value["adapter"],
        sampling=pb.SamplingParams(**sampling, **value["structured"]),
        **value["input"],
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=generate_requests())
def test_fuzzed_requests_get_a_precise_status(stub, request):
    code, details, responses = generate(stub, request)
    event(f"{code.name} {request.WhichOneof('input')}")  # see --hypothesis-show-statistics
    if code is grpc.StatusCode.OK:
        assert responses[-1].WhichOneof("kind") == "final"
    else:
        assert code in CLIENT_MISTAKES, f"{code}: {details}"
        assert details and len(details) < 2000


def test_worker_serves_a_normal_request_after_the_fuzzing(stub, worker):  # runs after it, in file order
    code, _, responses = generate(
        stub, pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=4))
    )
    assert code is grpc.StatusCode.OK and responses[-1].final.usage.completion_tokens == 4
    assert worker.process.poll() is None


@pytest.mark.parametrize("name", DEEP)
def test_constraint_as_deep_as_its_bound_allows_leaves_the_worker_serving(stub, worker, name):
    """Compiling it recurses that deep: on a default thread's stack it killed the worker. Served,
    or stopped where the grammar engine's parser gives up (a right-recursive chain outgrows its
    rows), with the cause."""
    kind, build = DEEP[name]
    sampling = pb.SamplingParams(max_tokens=4, **{kind: deepest(build)})
    code, details, responses = generate(stub, pb.GenerateRequest(text="Hello", sampling=sampling))
    if code is grpc.StatusCode.OK:
        assert responses[-1].final.usage.completion_tokens >= 1
    else:
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "grammar engine" in details, details
    code, _, responses = generate(
        stub, pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=2))
    )
    assert code is grpc.StatusCode.OK and responses[-1].final.usage.completion_tokens == 2
    assert worker.process.poll() is None


def test_prompt_over_the_byte_bound_names_size_and_bound(stub):
    code, details, _ = generate(stub, pb.GenerateRequest(text="x" * (1 << 20)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"text prompt is {1 << 20} bytes; at most" in details and f"max_model_len {MAX_MODEL_LEN}" in details
    )


def test_message_over_max_message_bytes_is_refused_unread(stub):
    code, _, _ = generate(stub, pb.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1)))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        (pb.GenerateRequest(adapter="name\n", text="hi"), "adapter id 'name\\n' is invalid"),
        (
            pb.GenerateRequest(request_id="r" * 257, text="hi"),
            "request_id is 257 characters long; at most 256",
        ),
        (
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))),
            f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}",
        ),
    ],
    ids=["adapter-newline", "request-id", "stop-count"],
)
def test_small_limits_are_refused_by_name(stub, request_, named):
    code, details, _ = generate(stub, request_)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and named in details


def test_request_that_can_never_fit_is_refused_and_others_run(stub):
    running: list = []
    normal = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5] * 10), sampling=pb.SamplingParams(max_tokens=40)
    )
    thread = threading.Thread(target=lambda: running.append(generate(stub, normal)))
    thread.start()
    never = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5] * 10), sampling=pb.SamplingParams(max_tokens=200)
    )
    code, details, _ = generate(stub, never)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "(10 tokens) + max_tokens (200) exceeds max_model_len 128" in details
    thread.join(timeout=30)
    after = generate(stub, normal)
    for got, _, responses in (*running, after):
        assert got is grpc.StatusCode.OK and responses[-1].final.usage.completion_tokens == 40
