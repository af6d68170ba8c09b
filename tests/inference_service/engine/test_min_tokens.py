"""min_tokens (vLLM's): EOS and a request's stop token ids cannot end its output before it holds
that many tokens (nor its stop strings: test_detokenizer.py). On the tiny llama with the default
model's tokenizer, a bias of +100 makes every step's greedy token the end it names: the engine's
tokens equal transformers' greedy generate with min_new_tokens and the same bias, and its requests
end right after min_tokens. Refused where it cannot hold: past max_tokens, beside an output
constraint."""

import pytest
import torch

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams, Structured
from shared.errors import InvalidArgument

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    return Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=1024, max_model_len=128))


def _prompt(engine) -> list[int]:
    return engine.tokenizer.encode("The sky over the sea is")


@pytest.mark.parametrize("min_tokens", [0, 1, 4, MAX_TOKENS - 1])
def test_eos_waits_for_min_tokens_as_transformers_min_new_tokens_has_it(engine, tiny_chat_model, min_tokens):
    from transformers import AutoModelForCausalLM

    eos = engine.eos_token_ids[0]
    prompt = _prompt(engine)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=min_tokens, temperature=0, logit_bias=[(eos, 100.0)]
    )
    (ours,) = engine.generate([Request(prompt, params=params)])
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    theirs = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=min_tokens,
        do_sample=False,
        sequence_bias={(eos,): 100.0},
        eos_token_id=list(engine.eos_token_ids),
        pad_token_id=eos,
    )[0, len(prompt) :].tolist()
    assert ours.token_ids == theirs
    assert ours.token_ids[min_tokens:] == [eos] and ours.finish_reason == "stop"


def test_stop_token_ids_wait_too_and_ignore_eos_leaves_eos_free(engine):
    """A stop token id is an end min_tokens holds back; under ignore_eos, EOS is no end, and the
    bias still draws it from the first step."""
    eos, stop = engine.eos_token_ids[0], 17
    ask = dict(max_tokens=MAX_TOKENS, min_tokens=3, temperature=0)
    stopped = SamplingParams(**ask, stop_token_ids=[stop], logit_bias=[(stop, 100.0)])
    ignoring = SamplingParams(**ask, ignore_eos=True, logit_bias=[(eos, 100.0)])
    by_stop, by_nothing = engine.generate([Request(_prompt(engine), params=p) for p in (stopped, ignoring)])
    assert stop not in by_stop.token_ids[:3] and by_stop.token_ids[3:] == [stop]
    assert by_nothing.token_ids == [eos] * MAX_TOKENS and by_nothing.finish_reason == "length"


def test_min_tokens_it_cannot_hold_is_refused_by_name(engine):
    with pytest.raises(InvalidArgument, match=r"min_tokens \(11\) exceeds max_tokens \(10\)"):
        engine.generate([Request(_prompt(engine), params=SamplingParams(max_tokens=10, min_tokens=11))])
    with pytest.raises(InvalidArgument, match="min_tokens cannot go with an output constraint"):
        SamplingParams(min_tokens=2, structured=Structured("json_object"))
    with pytest.raises(InvalidArgument, match="min_tokens must be an integer >= 0"):
        SamplingParams(min_tokens=-1)


def test_the_requests_own_bias_holds_while_its_ends_wait(engine):
    eos = engine.eos_token_ids[0]
    params = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=3, temperature=0, logit_bias=[(17, 50.0), (eos, 100.0)]
    )
    (out,) = engine.generate([Request(_prompt(engine), params=params)])
    assert out.token_ids == [17, 17, 17, eos]


def test_a_stop_string_waits_for_min_tokens_too(engine):
    """The text of the first greedy token as a stop string ends the output at once; with
    min_tokens 3 it is passed over there, and the output runs on to at least 3 tokens."""
    ask = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    (plain,) = engine.generate([Request(_prompt(engine), params=SamplingParams(**ask))])
    first = engine.tokenizer.decode(plain.token_ids[:1])
    outs = engine.generate(
        [Request(_prompt(engine), params=SamplingParams(**ask, stop=[first], min_tokens=m)) for m in (0, 3)]
    )
    assert (outs[0].token_ids, outs[0].text) == (plain.token_ids[:1], "")
    assert len(outs[1].token_ids) >= 3 and outs[1].text.startswith(first)


def test_a_stop_token_id_past_the_vocabulary_has_nothing_to_ban(engine):
    """It can never be drawn, so it is no end to hold back: the request is served (banning it
    indexed past the logits and ended the engine)."""
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=4, min_tokens=2, temperature=0, stop_token_ids=[vocab, 2**31 - 1])
    (out,) = engine.generate([Request(_prompt(engine), params=params)])
    assert len(out.token_ids) >= 2 and out.finish_reason in ("stop", "length")
