"""Structured outputs and tool calls through the gateway, with the official openai client, against
real gateway, worker and store processes. The chat model has random weights, so every output that
parses and validates does so because of the constraint, for the base model and two adapters, at
temperature 1: `response_format` (a pydantic model through `parse`, JSON schemas, any JSON
object), vLLM's `structured_outputs` (json, regex, choice, grammar), and forced tool choices
(named and "required") whose calls' arguments validate against their tools' schemas, whole and
streamed."""

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import ADAPTERS
from .test_errors import error_of

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["city", "zip"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": {  # enums, a nested object by $ref, a bounded array, integer bounds, a pattern
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 5},
                "minItems": 1,
                "maxItems": 3,
            },
            "home": {"$ref": "#/$defs/place"},
        },
        "required": ["name", "age", "role", "tags", "home"],
        "additionalProperties": False,
        "$defs": {"place": PLACE},
    },
    "order": {  # an array of nested objects, numbers, booleans, an optional property
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^ord-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"enum": ["A1", "B2", "C3"]},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "paid": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["id", "items", "paid"],
        "additionalProperties": False,
    },
    "label": {"enum": ["positive", "negative", "neutral"]},
    "point": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "tag": {"$ref": "#/$defs/t"}},
        "required": ["x", "tag"],
        "additionalProperties": False,
        "$defs": {"t": {"type": "string", "pattern": "^[a-z]{2}$"}},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


class Place(BaseModel):
    city: str = Field(max_length=10)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(pattern=r"^[A-Z][a-z]{1,8}$")
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    home: Place


@pytest.fixture(scope="module")
def models(base_name) -> list[str]:
    return [base_name, *ADAPTERS]


def test_parse_returns_the_pydantic_object_for_the_base_model_and_two_adapters(client, models):
    for seed, model in enumerate(models):
        completion = client.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=Person, temperature=1, seed=seed, max_tokens=200
        )
        choice = completion.choices[0]
        assert isinstance(choice.message.parsed, Person), choice
        assert choice.finish_reason == "stop"


def test_sixty_sampled_completions_whole_and_streamed_validate_against_their_schemas(async_client, models):
    """4 schemas × 3 models × (whole, streamed) × n=3 = 72 completions at temperature 1, asked
    for half through `response_format` and half through `structured_outputs`, all at once."""

    async def one(schema_name: str, model: str, stream: bool, seed: int) -> list[tuple[str, str]]:
        schema = SCHEMAS[schema_name]
        ask = (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": schema_name, "schema": schema},
                }
            }
            if seed % 2
            else {"extra_body": {"structured_outputs": {"json": schema}}}
        )
        common = dict(model=model, messages=MESSAGES, temperature=1, seed=seed, n=3, max_tokens=400)
        if not stream:
            completion = await async_client.chat.completions.create(**common, **ask)
            return [(c.message.content, c.finish_reason) for c in completion.choices]
        texts, reasons = ["", "", ""], [None] * 3
        async for chunk in await async_client.chat.completions.create(**common, **ask, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                reasons[c.index] = c.finish_reason or reasons[c.index]
        return list(zip(texts, reasons, strict=True))

    async def every():
        cases = [(s, m, stream) for s in SCHEMAS for m in models for stream in (False, True)]
        results = await asyncio.gather(
            *(one(s, m, stream, seed) for seed, (s, m, stream) in enumerate(cases))
        )
        return [
            (s, text, reason)
            for (s, _, _), outputs in zip(cases, results, strict=True)
            for text, reason in outputs
        ]

    outputs = asyncio.run(every())
    assert len(outputs) == 72
    for schema_name, text, reason in outputs:
        assert reason == "stop", (schema_name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[schema_name])
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", text)), text  # compact: no free whitespace
    assert len({text for _, text, _ in outputs}) > 36  # sampled: mostly different


def test_any_json_object_regex_choice_and_grammar_hold(client, models):
    for seed, model in enumerate(models):
        obj = client.chat.completions.create(
            model=model, messages=MESSAGES, response_format={"type": "json_object"}, seed=seed, max_tokens=60
        ).choices[0]
        if obj.finish_reason == "stop":  # any object is unbounded: a cut one is not whole
            assert isinstance(json.loads(obj.message.content), dict)
        regex = client.completions.create(
            model=model,
            prompt="Code:",
            seed=seed,
            max_tokens=20,
            extra_body={"structured_outputs": {"regex": r"[A-F]{2}-\d{3}"}},
        ).choices[0]
        assert re.fullmatch(r"[A-F]{2}-\d{3}", regex.text) and regex.finish_reason == "stop"
        choice = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            seed=seed,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        ).choices[0]
        assert choice.message.content in ("yes", "no", "maybe so")
        grammar = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            seed=seed,
            max_tokens=30,
            extra_body={"structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'}},
        ).choices[0]
        assert (
            re.fullmatch(r"\([1-9](\+[1-9])*\)", grammar.message.content) or grammar.finish_reason == "length"
        )


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_named_and_required_tool_choices_return_valid_calls_whole_and_streamed(client, models):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, model in enumerate(models):
        for tool_choice, names in ((named, {"get_weather"}), ("required", {"get_weather", "get_time"})):
            ask = dict(model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=tool_choice)
            whole = client.chat.completions.create(**ask, seed=seed, max_tokens=120).choices[0]
            assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
            _check_calls(whole.message.tool_calls, names)
            with client.chat.completions.stream(**ask, seed=seed + 100, max_tokens=120) as stream:
                final = stream.get_final_completion().choices[0]  # the client's own accumulation
            assert final.finish_reason == "tool_calls"
            _check_calls(final.message.tool_calls, names)


def test_without_parallel_calls_required_makes_exactly_one(client):
    for seed in range(3):
        choice = client.chat.completions.create(
            model="all8",
            messages=MESSAGES,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1,
            seed=seed,
            max_tokens=120,
        ).choices[0]
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_a_conversation_with_tool_calls_and_results_goes_through_the_template(client):
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome","days":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    reply = client.chat.completions.create(
        model="qv4", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5
    ).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "length"


@pytest.mark.parametrize(
    ("ask", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "json_schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "grammar"),
    ],
)
def test_a_broken_constraint_is_400_naming_it_and_the_worker_goes_on(client, ask, says):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="all8", messages=MESSAGES, max_tokens=5, **ask)
    assert f"structured output {says}" in error_of(raised)["message"]
    ok = client.chat.completions.create(model="all8", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
