"""Every refusal in OpenAI's error shape with the status users expect, the gateway serving on."""

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest

from tests.adapter_store.conftest import ADMIN_TOKEN
from tests.e2e.conftest import WorkerProcess, free_port, until

from .conftest import API_KEY, MESSAGES, GatewayProcess, worker_stats

CHAT = {"messages": MESSAGES, "max_tokens": 4}
WORKER_TOKEN = "worker-secret"


def error_of(raised: pytest.ExceptionInfo) -> dict:
    """The parsed OpenAI error body of an APIStatusError."""
    return raised.value.response.json()["error"]


@dataclass(frozen=True)
class Reply:
    status_code: int
    body: bytes

    def json(self):
        return json.loads(self.body)


def post(gateway, path: str, content: bytes, key: str = API_KEY) -> Reply:
    """A raw POST (the openai client cannot send malformed bodies)."""
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return send(urllib.request.Request(f"{gateway.url}{path}", content, headers, method="POST"))


def get(url: str) -> Reply:
    return send(urllib.request.Request(url))


def send(request: urllib.request.Request) -> Reply:
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return Reply(reply.status, reply.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def test_an_unknown_model_is_404_in_openais_words(client):
    for model in ("no-such-adapter", "not a valid/name"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.chat.completions.create(model=model, **CHAT)
        assert error_of(raised) == {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"temperature": 5}, "temperature", "less than or equal to 2"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ({"service_tier": "flex"}, "service_tier", "`service_tier` is not supported"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"logit_bias": {"five": 1}}, "logit_bias.five", "valid integer"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024 items"),
        (  # the default model's template teaches no tool-call format: none to read calls in
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
            "teaches it no tool-call format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}
            | {"response_format": {"type": "json_object"}},
            "response_format",
            "`response_format` and `tool_choice` each constrain the output",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "g"}}}
            | {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
            "names 'g', which `tools` lacks",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"},
            "tools",
            "names a function twice",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "goes with, and only with"),
        ({"top_logprobs": 2}, "top_logprobs", "needs `logprobs`"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when `stream`"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "has `tool_call_id`"),
        (
            {"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]},
            "messages.0",
            "only assistant messages carry `reasoning_content`",
        ),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages.0.audio", "not permitted"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0.type",
            "'text'",
        ),
    ],
)
def test_bad_and_unsupported_parameters_are_400_naming_the_parameter(client, extra, param, says):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="all8", **CHAT, extra_body=extra)
    error = error_of(raised)
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_prompt_of_the_wrong_type_is_400_naming_it(client):
    for prompt in (5, [[5, "x"]], []):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="all8", prompt=prompt, max_tokens=1)
        assert error_of(raised)["param"] == "prompt" or error_of(raised)["param"].startswith("prompt."), (
            prompt
        )


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    reply = client.chat.completions.create(
        model="all8", service_tier="auto", store=False, tool_choice="none", **CHAT
    )
    assert reply.usage.completion_tokens == 4


def test_a_logit_bias_past_the_vocabulary_is_400_from_the_worker(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="all8", logit_bias={"4000000": 5}, **CHAT)
    assert "logit_bias token id 4000000 is outside the vocabulary" in error_of(raised)["message"]


def test_what_the_worker_refuses_is_400_with_its_reason(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="all8", prompt=[5, 6], max_tokens=10_000)
    assert "exceeds max_model_len" in error_of(raised)["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="all8", prompt="x", max_tokens=2, stop=[f"s{i}" for i in range(17)])
    assert "stop" in error_of(raised)["message"]


def test_malformed_json_and_bodies_too_large(gateway):
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        reply = post(gateway, "/v1/chat/completions", body)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    huge = b'{"model": "all8", "prompt": "' + b"x" * 70_000 + b'"}'  # the gateway takes 65,536 bytes
    reply = post(gateway, "/v1/completions", huge)
    assert reply.status_code == 413 and "error" in reply.json()
    assert (
        post(gateway, "/v1/completions", b'{"model": "all8", "prompt": "hi", "max_tokens": 1}').status_code
        == 200
    )


@contextmanager
def connection(gateway, timeout_s: float) -> Iterator[http.client.HTTPConnection]:
    """A raw connection, for what urllib cannot send (a chunked body, headers without their body);
    closed after, so a gateway left waiting for the rest of a body can still stop."""
    host, port = gateway.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        yield connection
    finally:
        connection.close()


def test_a_chunked_body_past_the_limit_is_413(gateway):
    """A chunked body declares no length: the gateway counts its bytes as they arrive."""
    body = b'{"model": "all8", "prompt": "' + b"x" * 70_000 + b'", "max_tokens": 1}'
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    chunks = (body[i : i + 8192] for i in range(0, len(body), 8192))
    with connection(gateway, timeout_s=30) as raw:
        raw.request("POST", "/v1/completions", chunks, headers, encode_chunked=True)
        reply = raw.getresponse()
        assert reply.status == 413 and "65536 bytes" in json.loads(reply.read())["error"]["message"]


def test_a_declared_length_past_the_limit_is_413_before_the_body_is_sent(gateway):
    """The refusal needs only the headers: a client is not made to upload what will be thrown away
    (here it never sends the body, so a gateway that waited for it would time out)."""
    with connection(gateway, timeout_s=5) as raw:
        raw.putrequest("POST", "/v1/completions")
        raw.putheader("authorization", f"Bearer {API_KEY}")
        raw.putheader("content-length", "1000000")
        raw.endheaders()
        reply = raw.getresponse()
        assert reply.status == 413 and "error" in json.loads(reply.read())


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": [2**70]}, "prompt.0"),
        ({"prompt": [[5, 2**31]]}, "prompt.0.1"),
        ({"top_k": 2**40}, "top_k"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids.0"),
    ],
)
def test_integers_past_int32_are_400_naming_the_parameter(gateway, extra, param):
    body = {"model": "all8", "prompt": "hi", "max_tokens": 1} | extra
    reply = post(gateway, "/v1/completions", json.dumps(body).encode())
    assert reply.status_code == 400, reply.body
    assert reply.json()["error"] == {
        "message": f"{param}: Input should be less than or equal to 2147483647",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


NESTED = b"[" * 30_000 + b"]" * 30_000  # 60 KB
UNREADABLE = {  # (path, body): json.loads raises RecursionError or ValueError, or reads a lone surrogate
    "nested-completion": ("/v1/completions", NESTED),
    "nested-chat": ("/v1/chat/completions", NESTED),
    "5000-digit-token": ("/v1/completions", b'{"model": "all8", "prompt": [' + b"7" * 5_000 + b"]}"),
    "surrogate-prompt": ("/v1/completions", b'{"model": "all8", "prompt": "\\ud800", "max_tokens": 1}'),
    "surrogate-content": (
        "/v1/chat/completions",
        b'{"model": "all8", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    ),
    "surrogate-model": ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}'),
}


@pytest.mark.parametrize(("path", "body"), UNREADABLE.values(), ids=UNREADABLE)
def test_json_past_what_the_parser_takes_is_400_naming_the_body(gateway, path, body):
    logged = len(gateway.log.read_text())
    reply = post(gateway, path, body)
    assert reply.status_code == 400, reply.body[:300]
    error = reply.json()["error"]
    assert error["message"].startswith("body: Invalid JSON") and error["param"] is None, error
    assert "Traceback" not in gateway.log.read_text()[logged:]
    assert (
        post(gateway, "/v1/completions", b'{"model": "all8", "prompt": "hi", "max_tokens": 1}').status_code
        == 200
    )


def worker_calls(worker) -> int:
    """Generate calls the worker has seen: finished ones and those in flight."""
    stats = worker_stats(worker)
    return sum(r.count for r in stats.requests) + stats.in_flight


def test_prompts_times_n_past_the_bound_is_400_before_any_call_starts(gateway, worker):
    calls = worker_calls(worker)
    body = {"model": "all8", "prompt": [[5, 6]] * 128, "n": 16, "max_tokens": 1}  # a 1 KB body
    reply = post(gateway, "/v1/completions", json.dumps(body).encode())
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "too_many_generations")
    assert "128 prompt(s) × n=16 = 2048 generations" in error["message"] and "at most 128" in error["message"]
    assert worker_calls(worker) == calls
    body["prompt"] = [[5, 6]] * 8  # 8 × 16: exactly the bound
    reply = post(gateway, "/v1/completions", json.dumps(body).encode())
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 128


def test_the_bound_is_a_flag_and_a_chats_n_counts_against_it(worker, store, tmp_path):
    flags = ["--worker", worker.address, "--store", store.address, "--max-generations-per-request", "4"]
    gateway = GatewayProcess(tmp_path / "gateway.log", *flags)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                client.chat.completions.create(model="all8", n=5, **CHAT)
            assert error_of(raised)["param"] == "n"
            assert (
                "1 prompt(s) × n=5 = 5 generations; this server starts at most 4"
                in error_of(raised)["message"]
            )
            reply = client.completions.create(model="all8", prompt=[[5], [6]], n=2, max_tokens=1)
            assert len(reply.choices) == 4
    finally:
        assert gateway.stop() == 0


def test_a_missing_or_wrong_api_key_is_401(gateway):
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as raised:
        bad.models.list()
    assert error_of(raised)["code"] == "invalid_api_key"
    assert post(gateway, "/v1/completions", b"{}", key="sk-wrong").status_code == 401
    unsigned = get(f"{gateway.url}/v1/models")
    assert unsigned.status_code == 401 and "Authorization: Bearer" in unsigned.json()["error"]["message"]


def test_a_client_gone_mid_stream_leaves_the_worker_no_running_request(client, worker, gateway):
    stream = client.completions.create(
        model="qv4", prompt=[7, 8, 9], max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    assert worker_stats(worker).running == 1
    stream.close()
    gone = time.monotonic()
    until(lambda: worker_stats(worker).running == 0, timeout_s=5)
    assert time.monotonic() - gone < 1.0
    until(lambda: "was cancelled by its caller" in worker.log.read_text(), timeout_s=5)


def test_a_client_gone_before_a_whole_completion_leaves_the_worker_no_running_request(gateway, worker):
    impatient = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=0.5)
    with impatient, pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model="qv4", prompt=[7, 8], max_tokens=4000, extra_body={"ignore_eos": True}
        )
    gone = time.monotonic()
    until(lambda: worker_stats(worker).running == 0, timeout_s=5)
    assert time.monotonic() - gone < 1.0


@pytest.fixture(scope="module")
def busy_worker(tmp_path_factory, chat_model):
    """A worker that holds one call at a time (--max-pending 1) and wants a token."""
    cache = tmp_path_factory.mktemp("busy") / "cache"
    process = WorkerProcess(
        chat_model, None, cache, "--max-pending", "1", "--api-token", WORKER_TOKEN
    ).start()
    yield process
    process.terminate()
    process.wait()


def test_overload_is_429_and_deadlines_504(busy_worker, store, tmp_path, base_name):
    flags = ["--worker", busy_worker.address, "--store", store.address, "--timeout", "1"]
    gateway = GatewayProcess(tmp_path / "gateway.log", *flags, "--worker-token", WORKER_TOKEN)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            long = dict(model=base_name, prompt=[5], max_tokens=4000, extra_body={"ignore_eos": True})
            stream = client.completions.create(stream=True, **long)
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as raised:
                client.completions.create(model=base_name, prompt=[5], max_tokens=2)
            assert error_of(raised)["type"] == "rate_limit_error"
            stream.close()
            until(lambda: worker_stats(busy_worker).in_flight == 0)
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(**long)  # a second's deadline; 4000 tokens take longer
            assert raised.value.status_code == 504
    finally:
        assert gateway.stop() == 0


@pytest.fixture(scope="module")
def one_seq_worker(tmp_path_factory, chat_model):
    """A worker that runs one sequence at a time and holds two calls: the second waits its turn."""
    cache = tmp_path_factory.mktemp("one-seq") / "cache"
    process = WorkerProcess(chat_model, None, cache, "--max-pending", "2", "--max-num-seqs", "1").start()
    yield process
    process.terminate()
    process.wait()


def test_a_refused_sample_is_answered_at_once_and_its_waiting_sibling_cancelled(
    one_seq_worker, store, tmp_path, base_name
):
    """Behind a running stream, of n=2 samples the worker admits one to wait and refuses the other:
    the 429 comes at once, not when the waiting sibling's first token would, and the sibling leaves
    the worker rather than holding its place for a request already answered."""
    flags = ["--worker", one_seq_worker.address, "--store", store.address]
    gateway = GatewayProcess(tmp_path / "gateway.log", *flags)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            long = dict(model=base_name, prompt=[5], max_tokens=4000, extra_body={"ignore_eos": True})
            stream = client.completions.create(stream=True, **long)
            next(iter(stream))
            asked = time.monotonic()
            with pytest.raises(openai.RateLimitError):
                client.completions.create(n=2, **long)
            assert time.monotonic() - asked < 1.0
            until(lambda: worker_stats(one_seq_worker).in_flight == 1, timeout_s=1)  # the stream alone
            stream.close()
    finally:
        assert gateway.stop() == 0


def test_the_workers_token_goes_with_every_call_and_without_it_the_worker_refuses(
    busy_worker, store, tmp_path
):
    flags = ["--worker", busy_worker.address, "--store", store.address]
    tokenless = GatewayProcess(tmp_path / "tokenless.log", *flags)
    try:
        client = openai.OpenAI(base_url=f"{tokenless.url}/v1", api_key="unused", max_retries=0)
        with client, pytest.raises(openai.AuthenticationError) as raised:
            client.completions.create(model="all8", prompt=[5], max_tokens=1)
        assert raised.value.response.json()["error"]["code"] == "unauthenticated"
    finally:
        assert tokenless.stop() == 0


def test_an_unreachable_worker_is_503(store, tmp_path):
    gateway = GatewayProcess(
        tmp_path / "gateway.log", "--worker", f"127.0.0.1:{free_port()}", "--store", store.address
    )
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        with client, pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model="all8", **CHAT)
        assert raised.value.status_code == 503 and error_of(raised)["type"] == "server_error"
        assert get(f"{gateway.url}/health").status_code == 503
    finally:
        assert gateway.stop() == 0


def test_load_and_unload_need_the_admin_token(gateway):
    body = b'{"lora_name": "x1", "lora_path": "/nowhere"}'
    assert post(gateway, "/v1/load_lora_adapter", body).status_code == 401  # the API key is not enough
    assert post(gateway, "/v1/unload_lora_adapter", b'{"lora_name": "x1"}').status_code == 401
    assert post(gateway, "/v1/unload_lora_adapter", b'{"lora_name": "x1"}', ADMIN_TOKEN).status_code == 404
