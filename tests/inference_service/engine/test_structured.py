"""Structured outputs in the engine: a request's constraint (a JSON schema, any JSON object, a
regex, a choice, a grammar) is compiled by llguidance when submitted, and every step samples only
tokens it allows. On the tiny llama with the default model's tokenizer (random weights, so
whatever the model says is the constraint's doing): greedy output equals transformers' logits
masked by hand with the same grammar engine; sampled outputs at temperature 1 validate against
their schemas; an unconstrained request beside constrained ones gives its tokens alone; a broken
constraint is refused before any token."""

import json
import re

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams, Structured
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


def test_greedy_output_equals_the_logits_masked_by_hand(engine, tiny_chat_model):
    """The reference: transformers' fp32 forward of the whole sequence each step, its last logits
    masked by an llguidance matcher of the same schema, argmax, the matcher fed the token."""
    from transformers import AutoModelForCausalLM

    structured = Structured("json_schema", json.dumps(SMALL))
    params = SamplingParams(max_tokens=40, temperature=0, structured=structured)
    prompt = _prompt(engine)
    (ours,) = engine.generate([Request(prompt, params=params)])

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
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    tokens = []
    while len(tokens) < 40 and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1:].clone()  # [1, vocab]
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
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
