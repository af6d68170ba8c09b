"""Chat and text completions through the gateway with the official openai client, checked against
the same requests through the loramux SDK (greedy: the same tokens)."""

import asyncio

import openai
import pytest

from .conftest import ADAPTERS, CONTEXT, MESSAGES

PROMPT = "The three primary colours are"


@pytest.fixture(params=[None, *ADAPTERS], ids=["base", *ADAPTERS])
def model(request, base_name) -> tuple[str, str | None]:
    """(the API's model name, the SDK's adapter)."""
    return (request.param or base_name, request.param)


def test_chat_whole_and_streamed_equal_the_sdks_greedy_tokens(client, sdk, model):
    name, adapter = model
    expected = sdk.complete(messages=MESSAGES, adapter=adapter, max_tokens=12, temperature=0)

    whole = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)

    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == expected.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.prompt_tokens, 12)
    assert whole.model == name and whole.id.startswith("chatcmpl-") and whole.created > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert {c.id for c in chunks} == {chunks[0].id} != {whole.id}


def test_text_completions_whole_and_streamed_with_the_async_client(async_client, sdk, model):
    name, adapter = model
    expected = sdk.complete(PROMPT, adapter=adapter, max_tokens=10, temperature=0)

    async def both():
        whole = await async_client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0)
        stream = await async_client.completions.create(
            model=name, prompt=PROMPT, max_tokens=10, temperature=0, stream=True
        )
        return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(both())
    assert whole.object == "text_completion" and whole.choices[0].text == expected.text
    assert whole.usage.prompt_tokens == expected.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_token_ids_as_the_prompt_equal_the_sdks(client, sdk):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    whole = client.completions.create(model=ADAPTERS[0], prompt=ids, max_tokens=6, temperature=0)
    for choice, prompt in zip(whole.choices, ids, strict=True):
        assert (
            choice.text
            == sdk.complete(token_ids=prompt, adapter=ADAPTERS[0], max_tokens=6, temperature=0).text
        )
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.prompt_tokens == 7 and whole.usage.completion_tokens == 12


def test_n_samples_have_their_own_index_and_summed_usage(client):
    whole = client.chat.completions.create(
        model=ADAPTERS[1], messages=MESSAGES, max_tokens=8, n=3, seed=7, temperature=1.0
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) > 1  # independent samples, not one copied
    assert whole.usage.completion_tokens == 24
    single = client.chat.completions.create(model=ADAPTERS[1], messages=MESSAGES, max_tokens=8, seed=7)
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert single.choices[0].message.content == whole.choices[0].message.content  # sample 0 keeps the seed

    stream = client.chat.completions.create(
        model=ADAPTERS[1], messages=MESSAGES, max_tokens=8, n=3, seed=7, temperature=1.0, stream=True
    )
    texts, finished = ["", "", ""], []
    for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append(choice.index)
    assert texts == [c.message.content for c in whole.choices]
    assert sorted(finished) == [0, 1, 2]


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}, {"include_usage": True}])
def test_include_usage_sends_exactly_one_usage_chunk(client, options):
    extra = {} if options is None else {"stream_options": options}
    chunks = list(
        client.chat.completions.create(
            model=ADAPTERS[0], messages=MESSAGES, max_tokens=5, temperature=0, stream=True, **extra
        )
    )
    with_usage = [c for c in chunks if c.usage is not None]
    if not (options or {}).get("include_usage"):
        assert with_usage == []
        return
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_the_same_seed_gives_the_same_text(client):
    def sample(seed):
        reply = client.completions.create(model=ADAPTERS[0], prompt=PROMPT, max_tokens=12, seed=seed)
        return reply.choices[0].text

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_stop_strings_cut_the_text(client, sdk, base_name):
    full = sdk.complete(PROMPT, max_tokens=24, temperature=0).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: no usable stop string in {full!r}"
    for stops in (stop, [stop, "never appears ~~"]):
        reply = client.completions.create(
            model=base_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stops
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].text == full[: full.index(stop)]


def test_chat_logprobs_name_each_token_and_its_alternatives(client):
    reply = client.chat.completions.create(
        model=ADAPTERS[0], messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    assert b"".join(bytes(e.bytes) for e in content) == choice.message.content.encode()
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.logprob == values[0]  # greedy takes the most likely token
        assert entry.token == entry.top_logprobs[0].token

    alone = client.chat.completions.create(
        model=ADAPTERS[0], messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True
    )
    assert [e.top_logprobs for e in alone.choices[0].logprobs.content] == [[]] * 10
    assert [e.logprob for e in alone.choices[0].logprobs.content] == [e.logprob for e in content]
    plain = client.chat.completions.create(model=ADAPTERS[0], messages=MESSAGES, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None


def test_text_logprobs_and_offsets(client):
    reply = client.completions.create(
        model=ADAPTERS[1], prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert len(tokens) == 8 and "".join(tokens) == choice.text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]
    assert all(
        len(top) <= 2 and max(top.values()) == lp
        for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True)
    )


def test_without_max_tokens_a_completion_runs_to_the_context_limit(client):
    prompt = [5, 6, 7] * ((CONTEXT - 8) // 3)  # a few tokens short of the context
    reply = client.completions.create(
        model=ADAPTERS[0], prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == CONTEXT - len(prompt) > 1


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    prompt = list(range(10, 90))  # 80 tokens: several full KV blocks
    first = client.completions.create(model=ADAPTERS[1], prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=ADAPTERS[1], prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < 80


def test_logit_bias_bans_and_forces_tokens_as_the_sdk_does(client, sdk):
    """OpenAI's logit_bias (token ids as string keys): -100 bans the token greedy decoding would
    take, +100 makes every step take one token; each equals the SDK's request with the same bias."""
    adapter, ask = ADAPTERS[0], dict(prompt=PROMPT, max_tokens=6, temperature=0)
    first = sdk.complete(adapter=adapter, **ask).token_ids[0]
    for bias, check in (
        ({first: -100}, lambda ids: first not in ids),
        ({17: 100}, lambda ids: ids == [17] * 6),
    ):
        expected = sdk.complete(adapter=adapter, logit_bias=bias, **ask)
        got = client.completions.create(
            model=adapter, logit_bias={str(t): b for t, b in bias.items()}, **ask
        ).choices[0]
        assert got.text == expected.text and check(expected.token_ids), (bias, expected.token_ids)


def test_min_tokens_holds_back_an_eos_the_bias_draws_as_the_sdk_does(client, sdk, base_name):
    """vLLM's min_tokens: with EOS biased to be every step's greedy token, the reply ends right after
    min_tokens, the same through the gateway as through the SDK."""
    eos = sdk.model_info().eos_token_ids[0]
    ask = dict(prompt=PROMPT, max_tokens=12, temperature=0)
    expected = sdk.complete(**ask, logit_bias={eos: 100}, min_tokens=5)
    got = client.completions.create(
        model=base_name, **ask, logit_bias={str(eos): 100}, extra_body={"min_tokens": 5}
    )
    assert expected.completion_tokens == 6 and expected.token_ids[5] == eos
    assert (got.choices[0].text, got.usage.completion_tokens) == (expected.text, 6)
    assert got.choices[0].finish_reason == "stop"


def test_an_included_stop_string_ends_the_text_as_the_sdk_has_it(client, sdk, base_name):
    """vLLM's include_stop_str_in_output: the stop string that ended the text stays at its end;
    without it the text ends just before."""
    ask = dict(prompt=PROMPT, max_tokens=12, temperature=0)
    plain = sdk.complete(**ask).text
    stop = plain[4:8]
    at = plain.index(stop)
    for include, text in ((True, plain[: at + len(stop)]), (False, plain[:at])):
        expected = sdk.complete(**ask, stop=[stop], include_stop_str_in_output=include)
        got = client.completions.create(
            model=base_name, **ask, stop=[stop], extra_body={"include_stop_str_in_output": include}
        ).choices[0]
        assert got.text == expected.text == text and got.finish_reason == "stop"


def test_special_tokens_stay_in_the_text_when_asked_as_the_sdk_has_it(client, sdk, base_name):
    """vLLM's skip_special_tokens: a special token the bias forces is in the text only with false;
    the token ids carry it either way."""
    ask = dict(prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={1: 100})
    for skip, text in ((True, ""), (False, "<|im_start|>" * 3)):
        expected = sdk.complete(**ask, skip_special_tokens=skip)
        got = client.completions.create(
            model=base_name, **{**ask, "logit_bias": {"1": 100}}, extra_body={"skip_special_tokens": skip}
        ).choices[0]
        assert got.text == expected.text == text and expected.token_ids == [1] * 3


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_turn_a_repeating_text_as_the_sdk_does(
    client, sdk, base_name, penalty
):
    """A penalty on what the output holds so far turns greedy decoding from repeating it, the same
    through the gateway as through the SDK."""
    ask = dict(prompt=PROMPT, max_tokens=16, temperature=0)
    plain = sdk.complete(**ask)
    assert len(set(plain.token_ids)) < len(plain.token_ids)  # greedy repeats itself here
    expected = sdk.complete(**ask, **{penalty: 2.0})
    got = client.completions.create(model=base_name, **ask, **{penalty: 2.0}).choices[0]
    assert got.text == expected.text and expected.token_ids != plain.token_ids


@pytest.mark.parametrize(
    "options",
    [{"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}],
    ids=["continue", "continue-without-generation-prompt"],
)
def test_a_continued_answer_is_the_sdks_greedy_continuation_of_transformers_prompt(
    client, sdk, base_name, chat_model, options
):
    """vLLM's continue_final_message: the prompt is the chat as transformers renders it with the
    final message open, and the reply goes on from the answer begun for the model."""
    from transformers import AutoTokenizer

    begun = [*MESSAGES, {"role": "assistant", "content": "The sky is"}]
    reference = AutoTokenizer.from_pretrained(chat_model)
    prompt = reference.apply_chat_template(begun, tokenize=False, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\nThe sky is")
    expected = sdk.complete(token_ids=reference.encode(prompt), max_tokens=8, temperature=0)
    reply = client.chat.completions.create(
        model=base_name, messages=begun, max_tokens=8, temperature=0, extra_body=options
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens


def test_a_prompt_without_a_generation_prompt_ends_with_the_last_turn(client, sdk, base_name, chat_model):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(MESSAGES, tokenize=False)
    expected = sdk.complete(prompt, max_tokens=4, temperature=0)
    reply = client.chat.completions.create(
        model=base_name,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == (
        expected.text,
        expected.prompt_tokens,
    )


def test_continuing_the_final_message_and_opening_a_reply_at_once_is_a_400(client, base_name):
    both = {"continue_final_message": True, "add_generation_prompt": True}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=base_name, messages=MESSAGES, max_tokens=4, extra_body=both)
    assert raised.value.body["param"] == "continue_final_message"
    assert "cannot both be true" in raised.value.body["message"]
