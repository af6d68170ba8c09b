"""Generate through the SDK against real workers: the tiny llama (token ids only, fast steps) for
streaming, the final Completion, cancellation, typed errors and deadlines; the default model for
text, chat and stop strings. What the worker did is read back through its GetStats RPC."""

import asyncio
import time

import grpc
import pytest

import loramux
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from tests.adapter_store.conftest import ADMIN_TOKEN
from tests.client.conftest import API_TOKEN

PROMPT = [5, 6, 7]
LONG = dict(token_ids=[5, 6], max_tokens=4000, ignore_eos=True)  # seconds of steps on the tiny llama
CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def registered(store, sources_root) -> dict[str, str]:
    """qv4 registered in the tiny worker's store: adapter id -> digest."""
    with loramux.Client(store=store.address, admin_token=ADMIN_TOKEN, timeout=30) as admin:
        return {"qv4": admin.register_adapter("qv4", f"file://{sources_root / 'qv4'}").digest}


@pytest.fixture
def client(worker):
    with loramux.Client(worker=worker.address, timeout=30) as client:
        yield client


@pytest.fixture
def default_client(default_worker):
    with loramux.Client(worker=default_worker.address, api_token=API_TOKEN, timeout=60) as client:
        yield client


@pytest.fixture
def stats(worker):
    """Reads the tiny worker's GetStats."""
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        yield lambda: stub.GetStats(pb.GetStatsRequest())


def test_deltas_stream_then_result_holds_the_completion(client, registered):
    stream = client.generate(
        token_ids=PROMPT, adapter="qv4", request_id="mine", max_tokens=6, temperature=0, ignore_eos=True
    )
    deltas = list(stream)

    # a token per engine step, or several joined into one delta when the reader fell behind
    assert all(d.token_ids for d in deltas) and sum(len(d.token_ids) for d in deltas) == 6
    result = stream.result
    assert result.token_ids == [t for d in deltas for t in d.token_ids]
    assert (result.text, result.finish_reason) == ("", "length")  # no tokenizer: ids only
    assert (result.prompt_tokens, result.completion_tokens) == (3, 6)
    assert 0 < result.time_to_first_token_s <= result.total_s < 30
    assert result.request_id == "mine" and len(result.worker_request_id) == 32


def test_greedy_repeats_and_a_seed_fixes_sampling(client):
    def tokens(**sampling) -> list[int]:
        return client.complete(token_ids=PROMPT, max_tokens=12, ignore_eos=True, **sampling).token_ids

    assert tokens(temperature=0) == tokens(temperature=0.0)
    seeded = tokens(temperature=1.5, seed=7)
    assert tokens(temperature=1.5, seed=7) == seeded != tokens(temperature=1.5, seed=8)


def test_leaving_the_loop_early_aborts_the_request_on_the_worker(client, stats):
    aborted = _aborted(stats())
    stream = client.generate(**LONG)
    for _ in stream:
        break
    assert stream.result is None
    _until(lambda: _idle(stats()) and _aborted(stats()) == aborted + 1)


def test_errors_are_typed_and_carry_the_workers_message(client):
    with pytest.raises(loramux.NotFound) as e:
        client.complete(token_ids=PROMPT, adapter="no-such-adapter")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in e.value.message
    with pytest.raises(loramux.InvalidArgument) as e:
        client.complete(token_ids=PROMPT, top_p=1.5)
    assert "top_p" in e.value.message
    with pytest.raises(loramux.InvalidArgument) as e:
        client.complete("a prompt the tiny llama cannot tokenize")
    assert "tokenizer" in e.value.message
    assert isinstance(e.value, loramux.LoramuxError)


def test_inputs_and_sampling_arguments_are_checked_before_sending(client):
    with pytest.raises(ValueError, match="exactly one"):
        client.generate("a", token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        client.generate()
    with pytest.raises(ValueError, match="role"):
        client.generate(messages=[{"content": "no role"}])
    with pytest.raises(TypeError, match="max_token"):
        client.generate("a", max_token=3)


def test_timeout_is_a_deadline_per_client_and_per_call_and_the_worker_gives_up(worker, client, stats):
    with loramux.Client(worker=worker.address, timeout=0.3) as hasty:
        with pytest.raises(loramux.DeadlineExceeded) as e:
            hasty.complete(**LONG)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (
            hasty.complete(token_ids=PROMPT, max_tokens=20, ignore_eos=True, timeout=30).completion_tokens
            == 20
        )
    with pytest.raises(loramux.DeadlineExceeded):
        client.complete(**LONG, timeout=0.3)
    _until(lambda: _idle(stats()))


def test_worker_adapters_and_model_info(client, registered):
    client.complete(token_ids=PROMPT, adapter="qv4", max_tokens=1)
    held = client.worker_adapters()
    assert [(a.adapter_id, a.digest, a.pinned) for a in held] == [("qv4", registered["qv4"], False)]
    assert held[0].location in ("device", "host")
    info = client.model_info()
    assert (info.model_type, info.vocab_size, info.eos_token_ids) == ("llama", 160, [2])
    assert (info.max_loras, info.has_chat_template, info.tool_call_format) == (2, False, "")


def test_async_client_streams_cancels_and_raises_the_same(worker, client, stats, registered):
    expected = client.complete(token_ids=PROMPT, adapter="qv4", max_tokens=5, temperature=0)
    aborted = _aborted(stats())

    async def scenario():
        async with loramux.AsyncClient(worker=worker.address, timeout=30) as aclient:
            stream = aclient.generate(token_ids=PROMPT, adapter="qv4", max_tokens=5, temperature=0)
            ids = [t async for delta in stream for t in delta.token_ids]
            assert ids == expected.token_ids and stream.result.finish_reason == expected.finish_reason
            assert (
                await aclient.complete(token_ids=[9], max_tokens=2, ignore_eos=True)
            ).completion_tokens == 2

            long = aclient.generate(**LONG)
            async for _ in long:
                break
            await asyncio.to_thread(_until, lambda: _idle(stats()) and _aborted(stats()) == aborted + 1)

            with pytest.raises(loramux.NotFound):
                await aclient.complete(token_ids=PROMPT, adapter="no-such-adapter")
            with pytest.raises(loramux.DeadlineExceeded):
                await aclient.complete(**LONG, timeout=0.3)
            assert [a.adapter_id for a in await aclient.worker_adapters()] == ["qv4"]
            assert (await aclient.model_info()).vocab_size == 160

    asyncio.run(scenario())


def test_chat_messages_go_through_the_chat_template(default_client):
    messages = [{"role": "system", "content": "Answer in one short sentence."}, ("user", CAPITAL)]
    stream = default_client.generate(messages=messages, max_tokens=24, temperature=0)
    texts = [delta.text for delta in stream]
    result = stream.result
    assert "Paris" in result.text and "".join(texts) == result.text
    assert result.finish_reason == "stop" and result.completion_tokens < 24  # it ended on EOS


def test_a_stop_string_ends_the_text_before_it(default_client):
    prompt = "The capital of France is"
    whole = default_client.complete(prompt, max_tokens=8, temperature=0)
    assert whole.text.startswith(" Paris") and whole.finish_reason == "length"
    stopped = default_client.complete(prompt, max_tokens=8, temperature=0, stop=" answer")
    assert " answer" in whole.text and " answer" not in stopped.text
    assert whole.text.startswith(stopped.text) and stopped.text.startswith(" Paris")
    assert stopped.finish_reason == "stop" and stopped.completion_tokens < 8


def test_async_chat_and_a_missing_or_wrong_token(default_worker):
    async def scenario():
        address = default_worker.address
        async with loramux.AsyncClient(worker=address, api_token=API_TOKEN, timeout=60) as aclient:
            result = await aclient.complete(messages=[("user", CAPITAL)], max_tokens=24, temperature=0)
            assert "Paris" in result.text
        async with loramux.AsyncClient(worker=address) as anonymous:
            with pytest.raises(loramux.Unauthenticated):
                await anonymous.complete("hi")
        async with loramux.AsyncClient(worker=address, api_token="wrong") as wrong:
            with pytest.raises(loramux.PermissionDenied):
                await wrong.complete("hi")

    asyncio.run(scenario())


def _aborted(stats: pb.Stats) -> int:
    return sum(r.count for r in stats.requests if r.outcome == "abort")


def _idle(stats: pb.Stats) -> bool:
    return (stats.running, stats.waiting, stats.in_flight, stats.kv_blocks_used) == (0, 0, 0, 0)


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
