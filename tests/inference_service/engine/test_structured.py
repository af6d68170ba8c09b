"""Structured outputs in the engine: a request's constraint (a JSON schema, any JSON object, a
regex, a choice, a grammar) is compiled by llguidance when submitted, and every step samples only
tokens it allows. On the tiny llama with the default model's tokenizer (random weights, so
whatever the model says is the constraint's doing): greedy output equals transformers' logits
masked by hand with the same grammar engine; sampled outputs at temperature 1 validate against
their schemas; an unconstrained request beside constrained ones gives its tokens alone; a broken
constraint is refused before any token. A constraint compiles beside the running steps (a cold
one, with the grammar engine's tokenizer, takes a fifth of a second or more), within a bound, and
survives preemption."""

import asyncio
import json
import re
import time
from unittest import mock

import jsonschema
import llguidance
import llguidance.numpy
import pytest
import torch

from inference_service.engine import Engine, EngineConfig, Request, sequence_sampling
from inference_service.engine.grammars import Grammars
from inference_service.sampling import SamplingParams, Structured
from kernels.cpu_token_mask import CpuTokenMask
from shared.errors import InvalidArgument

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "role", "tags", "home"],
    "additionalProperties": False,
    "$defs": {
        "place": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        }
    },
}
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    return Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=4096, max_model_len=512))


def _text(engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens)


def _prompt(engine) -> list[int]:
    return engine.tokenizer.encode("Describe a person as JSON.")


def _json(engine, out) -> object:
    return json.loads(_text(engine, [t for t in out.token_ids if t not in engine.tokenizer.eos_token_ids]))


def test_greedy_output_equals_the_logits_masked_by_hand(engine, tiny_chat_model):
    """The reference: transformers' fp32 forward of the whole sequence each step, its last logits
    masked by an llguidance matcher of the same schema, argmax, the matcher fed the token; the
    engine masks through its CPU kernel (kernels/cpu_token_mask.py), once a token. (The
    mask goes through llguidance's numpy helpers: its torch ones are torch.compile'd, and where
    inductor vectorizes for AVX2 they left 497 of 1,000 logits finite where one token was
    allowed.)"""
    from transformers import AutoModelForCausalLM

    structured = Structured("json_schema", json.dumps(SMALL))
    params = SamplingParams(max_tokens=40, temperature=0, structured=structured)
    prompt = _prompt(engine)
    assert engine.runner.cpu_kernels.token_mask is not None  # a CPU worker's masks: its kernel's
    with mock.patch.object(
        CpuTokenMask, "__call__", autospec=True, side_effect=CpuTokenMask.__call__
    ) as fill:
        (ours,) = engine.generate([Request(prompt, params=params)])
    assert fill.call_count == len(ours.token_ids)

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tokenizer = llguidance.LLTokenizer(
        (tiny_chat_model / "tokenizer.json").read_text(),
        n_vocab=vocab,
        eos_token=list(engine.tokenizer.eos_token_ids),
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SMALL), defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    tokens = []
    while len(tokens) < 40 and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1:].clone()  # [1, vocab]
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.numpy.apply_token_bitmask_inplace(logits.numpy(), bitmask)  # in place: shares memory
        tokens.append(int(logits.argmax()))
        assert matcher.consume_token(tokens[-1])
    assert ours.token_ids == tokens
    assert ours.finish_reason == "stop"
    jsonschema.validate(
        json.loads(_text(engine, [t for t in tokens if t not in engine.tokenizer.eos_token_ids])), SMALL
    )


def test_sampled_outputs_validate_against_their_schemas(engine):
    """Temperature 1, a seed each: enums, nested objects through $ref, arrays with bounds, integer
    bounds, string patterns and lengths; compact JSON, ended within the bound."""
    params = [
        SamplingParams(
            max_tokens=200, temperature=1.0, seed=s, structured=Structured("json_schema", json.dumps(schema))
        )
        for s, schema in enumerate([PERSON, SMALL] * 4)
    ]
    outputs = engine.generate([Request(_prompt(engine), params=p) for p in params])
    for out, p in zip(outputs, params, strict=True):
        assert out.finish_reason == "stop", out
        text = _text(engine, [t for t in out.token_ids if t not in engine.tokenizer.eos_token_ids])
        jsonschema.validate(json.loads(text), json.loads(p.structured.spec))
        assert "\n" not in text and ": " not in text and ", " not in text  # compact: no free whitespace


def test_regex_choice_object_and_grammar_hold(engine):
    cases = {
        "regex": (
            Structured("regex", r"[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t),
        ),
        "choice": (
            Structured("choice", choices=("red", "green", "blue")),
            lambda t: t in ("red", "green", "blue"),
        ),
        "grammar": (
            Structured("grammar", 'root ::= "yes" | "no" | "maybe"'),
            lambda t: t in ("yes", "no", "maybe"),
        ),
    }
    requests = [
        Request(_prompt(engine), params=SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=s))
        for i, (s, _) in enumerate(cases.values())
    ]
    for out, (name, (_, holds)) in zip(engine.generate(requests), cases.items(), strict=True):
        text = _text(engine, [t for t in out.token_ids if t not in engine.tokenizer.eos_token_ids])
        assert out.finish_reason == "stop" and holds(text), (name, text)


def test_any_json_object_opens_one_and_is_whole_when_it_stops(engine):
    """Any object is unbounded (a string may run on: a random model's strings do), so a request
    either stops on a whole object or is cut by max_tokens inside one."""
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=Structured("json_object"))
        for s in range(6)
    ]
    outputs = engine.generate([Request(_prompt(engine), params=p) for p in params])
    for out in outputs:
        text = _text(engine, [t for t in out.token_ids if t not in engine.tokenizer.eos_token_ids])
        assert text.startswith("{"), text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text


def test_an_unconstrained_request_beside_constrained_ones_gives_its_tokens_alone(engine):
    plain = Request(_prompt(engine), params=SamplingParams(max_tokens=24, temperature=1.0, seed=7))
    (alone,) = engine.generate([plain])
    constrained = [
        Request(
            _prompt(engine),
            params=SamplingParams(
                max_tokens=24,
                temperature=1.0,
                seed=s,
                structured=Structured("json_schema", json.dumps(PERSON)),
            ),
        )
        for s in range(3)
    ]
    beside = engine.generate(
        [constrained[0], Request(plain.prompt_token_ids, params=plain.params), *constrained[1:]]
    )
    assert beside[1].token_ids == alone.token_ids


def test_a_cut_constrained_output_says_length(engine):
    params = SamplingParams(
        max_tokens=5, temperature=0, structured=Structured("json_schema", json.dumps(PERSON))
    )
    (out,) = engine.generate([Request(_prompt(engine), params=params)])
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        (Structured("json_schema", '{"type": "objekt"}'), "objekt"),
        (Structured("json_schema", "{not json"), "not JSON"),
        (Structured("regex", "[0-9"), "regex"),
        (Structured("grammar", "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_broken_constraint_is_refused_before_any_token(engine, structured, says):
    with pytest.raises(InvalidArgument, match=says):
        engine.generate([Request(_prompt(engine), params=SamplingParams(structured=structured))])


def test_a_constraint_is_compiled_once(engine):
    structured = Structured(
        "json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    before = (engine.grammars.compiles, engine.grammars.hits)
    engine.generate(
        [
            Request(_prompt(engine), params=SamplingParams(max_tokens=8, structured=structured))
            for _ in range(3)
        ]
    )
    assert (engine.grammars.compiles, engine.grammars.hits) == (before[0] + 1, before[1] + 2)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(kind="xml"), "none of"),
        (dict(kind="choice"), "needs at least one"),
        (dict(kind="regex"), "needs a text"),
        (dict(kind="json_object", spec="{}"), "takes no text"),
        (dict(kind="regex", spec="a" * (64 << 10) + "a"), "at most"),
    ],
)
def test_malformed_constraints_are_refused_when_built(kwargs, says):
    with pytest.raises(InvalidArgument, match=says):
        Structured(**kwargs)


def test_a_whole_constrained_output_stops_even_when_eos_is_ignored(engine):
    """ignore_eos keeps a request past the end-of-sequence token; a constraint that is whole has
    nothing more to say, so the request stops there."""
    params = SamplingParams(
        max_tokens=30,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        structured=Structured("choice", choices=("north", "south")),
    )
    (out,) = engine.generate([Request(_prompt(engine), params=params)])
    text = _text(engine, [t for t in out.token_ids if t not in engine.tokenizer.eos_token_ids])
    assert out.finish_reason == "stop" and text in ("north", "south") and len(out.token_ids) < 30


def test_constraints_compiled_from_many_threads_at_once_are_each_compiled_once(tiny_chat_model):
    """Each compile made slow (50 ms, the GIL released), so that threads asking for one
    constraint at once overlap: the first compiles it, the others wait and find it cached."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=256, max_model_len=256))
    compile_now = engine.grammars._compile

    def slow_compile(structured):
        time.sleep(0.05)
        return compile_now(structured)

    engine.grammars._compile = slow_compile
    constraints = [Structured("regex", f"[a-z]{{{n}}}") for n in range(1, 9)] * 4
    with ThreadPoolExecutor(8) as pool:
        matchers = list(pool.map(engine.grammars.matcher, constraints))
    assert (engine.grammars.compiles, engine.grammars.hits) == (8, 24)
    assert all(not m.is_error() for m in matchers)


def test_the_cache_keeps_the_most_recent_constraints(tiny_chat_model):
    from inference_service.engine.grammars import CACHE_SIZE

    engine = Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=256, max_model_len=256))
    constraints = [Structured("regex", f"x{n}") for n in range(CACHE_SIZE + 1)]
    for structured in constraints:
        engine.grammars.matcher(structured)
    engine.grammars.matcher(constraints[-1])  # kept
    assert (engine.grammars.compiles, engine.grammars.hits) == (CACHE_SIZE + 1, 1)
    engine.grammars.matcher(constraints[0])  # the oldest, dropped: compiled again
    assert engine.grammars.compiles == CACHE_SIZE + 2


# Optional properties, each with a pattern: llguidance takes a tenth of a second or more to compile
# it (under the 64 KiB bound), with the GIL released.
SLOW_COMPILE_S = 0.5


def test_streams_keep_their_tokens_coming_while_a_constraint_compiles(tiny_chat_model, monkeypatch):
    """A constraint that takes half a second to compile (within the 64 KiB bound, a schema whose
    definitions chain 1,700 deep takes about 0.4 s: tests/deep_constraints.py), made slow here:
    it first sleeps, letting go of the GIL as llguidance does while it compiles. Unconstrained streams run
    all along (one after another: the tiny model's window is short); while the constraint
    compiles, their deltas keep arriving, one per step, rather than waiting for the compile and
    arriving joined after it."""
    compile_now = Grammars._matcher_of

    def slow_compile(grammars, structured):
        time.sleep(SLOW_COMPILE_S)
        return compile_now(grammars, structured)

    monkeypatch.setattr(Grammars, "_matcher_of", slow_compile)
    engine = Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=1024, max_model_len=256))
    prompt = _prompt(engine)
    plain = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    structured = Structured("json_schema", json.dumps(PERSON))
    engine.start()

    async def scenario():
        arrivals: list[float] = []
        constrained_done = asyncio.Event()

        async def plain_traffic():
            while not constrained_done.is_set():
                async for _ in engine.stream(Request(prompt, params=plain)):
                    arrivals.append(time.perf_counter())

        traffic = asyncio.create_task(plain_traffic())
        while len(arrivals) < 5:
            await asyncio.sleep(0.001)
        start = time.perf_counter()
        request = Request(prompt, params=SamplingParams(max_tokens=8, temperature=0, structured=structured))
        deltas = []
        async for d in engine.stream(request):
            deltas.append((time.perf_counter(), d))
        constrained_done.set()
        await traffic
        return arrivals, start, deltas

    try:
        arrivals, start, deltas = asyncio.run(scenario())
        compile_s = engine.stats().grammars.compile_seconds.total
    finally:
        engine.stop()
    assert _text(engine, [t for _, d in deltas for t in d.token_ids]).startswith("{")
    end = start + compile_s
    during = [t for t in arrivals if start < t < end]
    waits = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
    print(
        f"cold compile {compile_s * 1e3:.0f} ms, first constrained token after "
        f"{(deltas[0][0] - start) * 1e3:.0f} ms; {len(during)} unconstrained deltas during the "
        f"compile, the longest wait for one {max(waits) * 1e3:.1f} ms"
    )
    assert len(during) >= 3, (compile_s, waits)


def test_a_compile_past_the_timeout_is_refused_and_then_served_from_the_cache(tiny_chat_model):
    config = EngineConfig(
        model=str(tiny_chat_model), kv_cache_tokens=512, max_model_len=256, grammar_compile_timeout_s=0.001
    )
    engine = Engine(config)  # cold: the first compile builds the grammar engine's tokenizer too
    params = SamplingParams(
        max_tokens=60, temperature=0, structured=Structured("json_schema", json.dumps(SMALL))
    )
    with pytest.raises(InvalidArgument, match="--grammar-compile-timeout"):
        engine.generate([Request(_prompt(engine), params=params)])
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (unconstrained,) = engine.generate([Request(_prompt(engine), params=plain)])
    assert unconstrained.finish_reason == "length" and len(unconstrained.token_ids) == 8

    deadline = time.monotonic() + 30
    while engine.grammars.stats().compiles == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the refused request's compile goes on
    (served,) = engine.generate([Request(_prompt(engine), params=params)])
    assert served.finish_reason == "stop"
    jsonschema.validate(_json(engine, served), SMALL)
    grammars = engine.stats().grammars
    assert (grammars.requests, grammars.compiles, grammars.hits) == (2, 1, 1)


def test_a_preempted_constrained_request_resumes_where_its_output_was(tiny_chat_model):
    """A KV cache of 24 blocks of 4: three unconstrained requests and a constrained one (the last
    admitted, so the first preempted) cannot all grow; the constrained one gives its blocks back,
    is computed again and goes on with the same matcher: its output is what it is alone."""
    config = EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=96, block_size=4, max_model_len=96)
    engine = Engine(config)
    prompt = _prompt(engine)
    structured = SamplingParams(
        max_tokens=80, temperature=0, structured=Structured("json_schema", json.dumps(PERSON))
    )
    (alone,) = engine.generate([Request(prompt, params=structured)])
    assert alone.preemptions == 0 and engine.stats().scheduler.preemptions == 0
    others = [
        Request(
            engine.tokenizer.encode(f"Count to {n}."), params=SamplingParams(max_tokens=60, ignore_eos=True)
        )
        for n in range(3)
    ]
    *_, preempted = engine.generate([*others, Request(prompt, params=structured)])
    assert preempted.preemptions > 0
    assert preempted.token_ids == alone.token_ids and preempted.finish_reason == "stop"
    jsonschema.validate(_json(engine, preempted), PERSON)


def test_seeded_samples_of_one_constraint_each_validate_and_repeat(engine):
    """Several samples of one constrained request (a seed each, in one batch) each validate, and
    the same seeds in another batch, in another order, draw the same tokens."""
    structured = Structured("json_schema", json.dumps(PERSON))
    seeds = [11, 12, 13]
    requests = [
        Request(
            _prompt(engine),
            params=SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=structured),
        )
        for s in seeds
    ]
    first = engine.generate(requests)
    again = engine.generate([Request(r.prompt_token_ids, params=r.params) for r in reversed(requests)])[::-1]
    for out in first:
        assert out.finish_reason == "stop", out
        jsonschema.validate(_json(engine, out), PERSON)
    assert len({tuple(out.token_ids) for out in first}) > 1  # the seeds draw different samples
    assert [out.token_ids for out in again] == [out.token_ids for out in first]


def test_a_stop_string_ends_a_constrained_output_with_a_logprob_per_token(engine):
    """The constraint would go on past the first "-"; the stop string ends the output there. The
    same seed without it draws the same tokens up to there and on."""
    structured = Structured("regex", r"[a-z]{4}-[a-z]{4}-[a-z]{4}")

    def params(**stop):
        return SamplingParams(
            max_tokens=40, temperature=1.0, seed=5, logprobs=3, structured=structured, **stop
        )

    (stopped,) = engine.generate([Request(_prompt(engine), params=params(stop=["-"]))])
    (whole,) = engine.generate([Request(_prompt(engine), params=params())])
    assert stopped.finish_reason == "stop" and re.fullmatch(r"[a-z]{4}", stopped.text), stopped.text
    assert re.fullmatch(r"[a-z]{4}-[a-z]{4}-[a-z]{4}", whole.text) and whole.text.startswith(
        stopped.text + "-"
    )
    assert len(stopped.token_ids) < len(whole.token_ids)
    assert stopped.token_ids == whole.token_ids[: len(stopped.token_ids)]
    assert len(stopped.logprobs) == len(stopped.token_ids)
    for token, lp in zip(stopped.token_ids, stopped.logprobs, strict=True):
        assert len(lp.top) == 3 and lp.logprob > float("-inf") and lp.top[0][1] >= lp.logprob, (token, lp)


def test_stats_count_constrained_requests_compiles_and_hits(tiny_chat_model):
    engine = Engine(EngineConfig(model=str(tiny_chat_model), kv_cache_tokens=512, max_model_len=256))
    assert engine.stats().grammars.requests == 0
    x, y = Structured("choice", choices=("yes", "no")), Structured("regex", "[0-9]{3}")
    prompt = _prompt(engine)

    def request(structured):
        return Request(prompt, params=SamplingParams(max_tokens=8, structured=structured))

    engine.generate([request(x), request(x), request(y)])
    engine.generate([request(x), request(None)])
    grammars = engine.stats().grammars
    assert (grammars.requests, grammars.compiles, grammars.hits) == (4, 2, 2)
    assert grammars.compile_seconds.count == 2 and grammars.compile_seconds.total > 0


def test_an_output_the_grammar_engine_stops_following_ends_in_an_error_not_a_stop(engine, monkeypatch):
    """Fault injection: masks that mask nothing let a token the constraint refuses be drawn (as a
    grammar engine past its limits on a step would leave its matcher). The request ends with
    INVALID_ARGUMENT naming the grammar engine's error, without that token, not as a whole output;
    the unconstrained request beside it runs on."""
    monkeypatch.setattr(sequence_sampling, "mask_rows", lambda logits, matchers, kernel: logits)
    choice = Structured("choice", choices=("yes", "no"))
    left, free = engine.generate(
        [
            Request(_prompt(engine), params=SamplingParams(max_tokens=5, temperature=0, structured=choice)),
            Request(_prompt(engine), params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        ]
    )
    assert left.finish_reason == "error" and isinstance(left.error, InvalidArgument)
    assert "structured output: the grammar engine could not go on" in str(left.error)
    assert left.token_ids == []
    assert free.finish_reason == "length" and len(free.token_ids) == 5


def test_a_constrained_request_on_a_cached_prefix_gives_what_it_gives_computed_in_full(engine):
    """The prompt's KV blocks from the prefix cache (computed for an earlier request) leave the
    constraint to the matcher: the same greedy output as when the prompt was computed in full."""
    prompt = engine.tokenizer.encode("A person, as JSON, whose name is long enough to fill a block: ")
    params = SamplingParams(
        max_tokens=120, temperature=0, structured=Structured("json_schema", json.dumps(PERSON))
    )
    (first,) = engine.generate([Request(prompt, params=params)])
    (cached,) = engine.generate([Request(prompt, params=params)])
    assert cached.cached_tokens > 0 and first.cached_tokens < cached.cached_tokens
    assert cached.token_ids == first.token_ids and cached.finish_reason == "stop"
    jsonschema.validate(_json(engine, cached), PERSON)
