"""Generate through the SDK against the fake worker (tests/client/fake_worker.py): streaming, the
final Completion, cancellation, mid-stream errors, deadlines and argument checks. The real worker's
answers are checked by the end-to-end tests."""

import asyncio

import grpc
import loramux
import pytest

from tests.client.fake_worker import API_TOKEN, FAILING, MISSING, SLOW


@pytest.fixture
def client(worker):
    address, _ = worker
    with loramux.Client(worker=address, api_token=API_TOKEN, timeout=30) as client:
        yield client


def test_deltas_stream_then_result_holds_the_completion(client, worker):
    _, fake = worker
    stream = client.generate(
        "one two", adapter="a1", request_id="r-stream", max_tokens=3, temperature=0.0, seed=7, stop="\n"
    )
    deltas = list(stream)

    assert [d.text for d in deltas] == ["one ", "two ", "one "]
    assert [d.token_ids for d in deltas] == [[0], [1], [2]]
    result = stream.result
    assert (result.text, result.token_ids, result.finish_reason) == ("one two one ", [0, 1, 2], "length")
    assert (result.prompt_tokens, result.completion_tokens) == (2, 3)
    assert (result.time_to_first_token_s, result.total_s) == pytest.approx((0.01, 0.02))
    sent = next(r for r in fake.requests if r.request_id == "r-stream")
    assert (sent.adapter, sent.text, sent.sampling.max_tokens, sent.sampling.seed) == ("a1", "one two", 3, 7)
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert list(sent.sampling.stop) == ["\n"] and not sent.sampling.HasField("top_p")


def test_a_stop_string_ends_generation_with_finish_reason_stop(client):
    result = client.complete("a b c d", stop=["c", "x"], max_tokens=10)
    assert (result.text, result.finish_reason, result.completion_tokens) == ("a b ", "stop", 2)


def test_complete_takes_token_ids_or_chat_messages(client, worker):
    _, fake = worker
    assert client.complete(token_ids=[5, 6], max_tokens=2).text == "5 6 "
    messages = [{"role": "system", "content": "be brief"}, ("user", "hi")]
    chat = client.complete(messages=messages, max_tokens=2, request_id="r-chat")
    assert chat.text == "system:be brief user:hi "
    sent = next(r for r in fake.requests if r.request_id == "r-chat")
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert sent.adapter == "" and sent.WhichOneof("input") == "chat"


def test_leaving_the_loop_early_cancels_the_call(client, worker):
    _, fake = worker
    stream = client.generate("a b", adapter=SLOW, request_id="r-cancel", max_tokens=200)
    for _ in stream:
        break
    assert fake.cut_short["r-cancel"].wait(5)
    assert stream.result is None


def test_errors_are_typed_before_and_during_the_stream(client, worker):
    address, _ = worker
    with pytest.raises(loramux.NotFound) as e:
        client.complete("x", adapter=MISSING)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and MISSING in e.value.message

    seen = []
    with pytest.raises(loramux.ResourceExhausted):
        for delta in client.generate("x", adapter=FAILING, max_tokens=5):
            seen.append(delta.text)
    assert seen == ["x ", "x "]

    with loramux.Client(worker=address) as anonymous, pytest.raises(loramux.Unauthenticated):
        anonymous.complete("x")


def test_timeout_is_a_deadline_per_client_and_per_call(worker):
    address, _ = worker
    with loramux.Client(worker=address, api_token=API_TOKEN, timeout=0.2) as client:
        with pytest.raises(loramux.DeadlineExceeded) as e:
            client.complete("x", adapter=SLOW, max_tokens=200)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.complete("x", adapter=SLOW, max_tokens=20, timeout=30).completion_tokens == 20


def test_inputs_and_sampling_arguments_are_checked_before_sending(client):
    with pytest.raises(ValueError, match="exactly one"):
        client.generate("a", token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        client.generate()
    with pytest.raises(ValueError, match="role"):
        client.generate(messages=[{"content": "no role"}])
    with pytest.raises(TypeError, match="max_token"):
        client.generate("a", max_token=3)


def test_worker_adapters_and_model_info(client):
    adapters = client.worker_adapters()
    assert [(a.adapter_id, a.location, a.pinned) for a in adapters] == [
        ("a1", "device", False),
        ("a2", "loading", True),
    ]
    info = client.model_info()
    assert (info.model_name, info.vocab_size, info.eos_token_ids) == ("tiny", 160, [2])


def test_async_client_streams_cancels_and_raises_the_same(worker):
    address, fake = worker

    async def scenario():
        async with loramux.AsyncClient(worker=address, api_token=API_TOKEN, timeout=30) as client:
            stream = client.generate("red green", max_tokens=3)
            texts = [delta.text async for delta in stream]
            assert texts == ["red ", "green ", "red "] and stream.result.finish_reason == "length"
            assert (await client.complete(token_ids=[9], max_tokens=2)).token_ids == [0, 1]

            slow = client.generate("a", adapter=SLOW, request_id="r-async-cancel", max_tokens=200)
            async for _ in slow:
                break
            assert await asyncio.to_thread(fake.cut_short["r-async-cancel"].wait, 5)

            with pytest.raises(loramux.ResourceExhausted):
                await client.complete("x", adapter=FAILING, max_tokens=5)
            with pytest.raises(loramux.DeadlineExceeded):
                await client.complete("x", adapter=SLOW, max_tokens=200, timeout=0.2)
            assert [a.location for a in await client.worker_adapters()] == ["device", "loading"]
            assert (await client.model_info()).model_type == "llama"

    asyncio.run(scenario())
