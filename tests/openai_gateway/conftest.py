"""A store, a worker and the gateway as real processes on loopback, reached with the official
`openai` client (max_retries=0: every error shows as it is) and the loramux SDK beside it."""

import json
import shutil
from pathlib import Path

import grpc
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from tokenizers import Tokenizer

import loramux
from inference_service.engine.grammars import Grammars
from shared.pb.loramux.inference.v1 import inference_pb2 as inference_pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.adapter_store.conftest import ADMIN_TOKEN, spawn
from tests.conftest import build_tiny_model
from tests.e2e.conftest import (  # noqa: F401 - fixtures
    WorkerProcess,
    s3_endpoint,
    sources_root,
    store,
    store_port,
)

API_KEY = "sk-gateway-test"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
ADAPTERS = ("all8", "qv4")  # registered for the whole module; others are loaded by the tests
CONTEXT = 4096  # the chat model's max_model_len: room for a stream that runs while a test acts


class GatewayProcess:
    """`python -m openai_gateway` on a free loopback port."""

    def __init__(self, log: Path, *flags: str):
        self.process, address = spawn("openai_gateway", ["--listen", "127.0.0.1:0", *flags], {}, log)
        self.url = f"http://{address}"
        self.log = log

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(timeout=15)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, default_model_dir) -> Path:
    """The tiny llama with the default model's tokenizer and chat template and a long context; its
    layer shapes equal the tiny llama's, so the store's adapters fit it."""
    vocab_size = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    path = tmp_path_factory.mktemp("chat") / "llama"
    build_tiny_model(path, vocab_size=vocab_size, max_position_embeddings=CONTEXT)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def worker(tmp_path_factory, chat_model, store):  # noqa: F811
    process = WorkerProcess(
        chat_model,
        store.address,
        tmp_path_factory.mktemp("gateway-worker") / "cache",
        "--max-loras",
        "2",
        "--kv-cache-tokens",
        str(4 * CONTEXT),
    ).start()
    yield process
    if process.process.poll() is None:
        process.terminate()
        assert process.wait() == 0


@pytest.fixture(scope="module")
def registered(store, sources_root):  # noqa: F811
    with loramux.Client(store=store.address, admin_token=ADMIN_TOKEN, timeout=60) as admin:
        return {name: admin.register_adapter(name, f"file://{sources_root / name}") for name in ADAPTERS}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, worker, store, registered):  # noqa: F811
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    flags = ["--worker", worker.address, "--store", store.address, "--api-key", API_KEY]
    process = GatewayProcess(log, *flags, "--admin-token", ADMIN_TOKEN, "--max-body-bytes", "65536")
    yield process
    assert process.stop() == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def base_name(chat_model) -> str:
    return chat_model.name


@pytest.fixture
def client(gateway) -> OpenAI:
    with OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def async_client(gateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def sdk(worker, store) -> loramux.Client:  # noqa: F811
    with loramux.Client(worker=worker.address, store=store.address, admin_token=ADMIN_TOKEN, timeout=60) as c:
        yield c


def worker_stats(worker) -> inference_pb.Stats:
    with grpc.insecure_channel(worker.address) as channel:
        return inference_grpc.InferenceServiceStub(channel).GetStats(inference_pb.GetStatsRequest())


@pytest.fixture(scope="module")
def text_tokenizer(default_model_dir) -> Tokenizer:
    """The default model's tokenizer (the tokenizers library's): the ids a text is to a matcher."""
    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(default_model_dir, text_tokenizer):
    """The worker's grammar engine on the default model's tokenizer: the constraints the gateway
    sends, compiled as a worker compiles them."""
    grammars = Grammars(
        default_model_dir / "tokenizer.json", text_tokenizer.get_vocab_size(), (2,), timeout_s=60
    )
    yield grammars
    grammars.close()


def client_on_template(
    tmp_path_factory,
    chat_model: Path,
    store,  # noqa: F811
    template: Path,
    tokenizer_json: str | None = None,
    *worker_flags: str,
):
    """A worker of the chat model with `template` as its chat template (and `tokenizer_json` as
    its tokenizer, where given; started with `worker_flags`) and a gateway before it: yields the
    official client and the model's name, then stops both (a module fixture yields from it)."""
    model = tmp_path_factory.mktemp(template.stem) / "llama"
    shutil.copytree(chat_model, model)
    (model / "chat_template.jinja").write_text(template.read_text())  # wins over tokenizer_config's
    if tokenizer_json is not None:
        (model / "tokenizer.json").write_text(tokenizer_json)
    cache = tmp_path_factory.mktemp(f"{template.stem}-cache") / "cache"
    worker = WorkerProcess(model, store.address, cache, *worker_flags)
    worker.start()
    log = tmp_path_factory.mktemp(f"{template.stem}-gateway") / "gateway.log"
    gateway = GatewayProcess(log, "--worker", worker.address, "--store", store.address, "--api-key", API_KEY)
    with OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client, model.name
    assert gateway.stop() == 0, log.read_text()[-3000:]
    worker.terminate()
    assert worker.wait() == 0


def whole_and_streamed(client: OpenAI, **ask) -> list:
    """The request's first choice asked for whole, then streamed (as the openai client gathers it)."""
    whole = client.chat.completions.create(**ask).choices[0]
    with client.chat.completions.stream(**ask) as stream:
        return [whole, stream.get_final_completion().choices[0]]


def answer_after_a_call(client: OpenAI, model: str, tools: list[dict], messages: list, call_constraint: dict):
    """Asks for a call (its constraint makes the random model write one), carries the call and a
    tool result back, and returns the next reply, written to a regex: its chat template rendered
    the call and the result."""
    ask = dict(model=model, tools=tools, max_tokens=80)
    first = client.chat.completions.create(
        messages=messages, extra_body={"structured_outputs": call_constraint}, **ask
    ).choices[0]
    [call] = first.message.tool_calls
    answered = [
        *messages,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    return client.chat.completions.create(
        messages=answered, extra_body={"structured_outputs": {"regex": "It is [a-z]{5}"}}, **ask
    ).choices[0]


def calls_under_auto_alone(client: OpenAI, model: str, tool: dict, messages: list, seed: int) -> list:
    """A reply to `messages` sampled under the gateway's grammar for the tool alone (no other
    constraint), checked to end as a reply may: its calls, each checked against the tool's schema."""
    choice = client.chat.completions.create(
        model=model, messages=messages, tools=[tool], max_tokens=32, temperature=1.0, seed=seed
    ).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    return choice.message.tool_calls or []


def one_call_whole_and_streamed(
    client: OpenAI, model: str, tool: dict, messages: list, call_constraint: dict, content: str
) -> list[dict]:
    """The reply written to `call_constraint`, whole and then streamed, checked to be `content`
    and one call of `tool` (an id, the tool's name, arguments of its schema) that ends the choice
    for "tool_calls"; the arguments of each."""
    ask = dict(model=model, messages=messages, tools=[tool], max_tokens=80)
    arguments = []
    for choice in whole_and_streamed(client, **ask, extra_body={"structured_outputs": call_constraint}):
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        [call] = choice.message.tool_calls
        assert call.function.name == tool["function"]["name"] and call.id.startswith("call_")
        arguments.append(json.loads(call.function.arguments))
        jsonschema.validate(arguments[-1], tool["function"]["parameters"])
    return arguments
