"""Every refusal in OpenAI's error shape with the status users expect, the gateway serving on."""

import json
import time
import urllib.error
import urllib.request
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
        ({"presence_penalty": 0.5}, "presence_penalty", "`presence_penalty` is not supported"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "`logit_bias` is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "`tools` is not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "needs `logprobs`"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when `stream`"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages.0.name", "not permitted"),
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
        model="all8", presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tool_choice="none", **CHAT
    )
    assert reply.usage.completion_tokens == 4


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
