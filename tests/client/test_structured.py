"""Structured outputs and tools through the SDK and the CLI, against the real default-model worker
(its tokenizer is what the grammar engine masks): every output constraint holds on sampled text,
conflicting or malformed arguments are refused before any call, the worker's refusals arrive as
InvalidArgument naming the problem, and a chat with tools, a tool call and its result goes
through."""

import json
import re

import jsonschema
import pytest

import loramux
from loramux import cli
from tests.client.conftest import API_TOKEN

PROMPT = 'JSON: {"a":1}\nJSON: {"b":"x"}\nJSON:'  # short objects: a real model's any-object ends
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'start: "sure" | "no" " " NUMBER\nNUMBER: /[0-9]/'  # Lark
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
UNREACHABLE = "127.0.0.1:1"  # a ValueError here proves no call was made


def _fits_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)  # raises, naming the violation
    return True


@pytest.fixture(scope="module")
def client(default_worker):
    with loramux.Client(worker=default_worker.address, api_token=API_TOKEN, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("constraint", "holds"),
    [
        ({"json_schema": SCHEMA}, _fits_schema),
        ({"json_schema": json.dumps(SCHEMA)}, _fits_schema),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"regex": REGEX, "json_object": False}, lambda t: re.fullmatch(REGEX, t)),
        ({"choice": ("yes", "no")}, lambda t: t in ("yes", "no")),  # as the CLI test: compiled once
        ({"grammar": GRAMMAR}, lambda t: re.fullmatch("sure|no [0-9]", t)),
    ],
    ids=["json_schema", "json_schema_text", "json_object", "regex", "choice", "grammar"],
)
def test_each_constraint_holds_on_sampled_output(client, constraint, holds):
    result = client.complete(PROMPT, max_tokens=30, temperature=1.0, seed=1, **constraint)
    assert result.finish_reason == "stop" and holds(result.text), result.text


def test_conflicting_or_malformed_constraints_are_refused_before_any_call():
    with loramux.Client(worker=UNREACHABLE, timeout=1) as client:
        with pytest.raises(ValueError, match="json_schema, regex"):
            client.generate("a", json_schema=SCHEMA, regex="a+", choice=None)
        with pytest.raises(ValueError, match="json_object, choice"):
            client.generate("a", json_object=True, choice=["x"])
        with pytest.raises(TypeError, match="not one string"):
            client.generate("a", choice="yes")
        with pytest.raises(TypeError, match="regex takes a str"):
            client.generate("a", regex=3)


def test_a_constraint_the_worker_cannot_compile_is_invalid_argument(client):
    with pytest.raises(loramux.InvalidArgument, match="nope"):
        client.complete("a", json_schema={"type": "nope"}, max_tokens=2)
    with pytest.raises(loramux.InvalidArgument, match="regex"):
        client.complete("a", regex="[0-9", max_tokens=2)


def test_a_chat_with_tools_a_tool_call_and_its_result_goes_through(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"sky": "sunny"}'},
    ]
    bare = WEATHER["function"]
    for tools in ([WEATHER], [bare]):
        result = client.complete(messages=messages, tools=tools, max_tokens=2, temperature=0)
        assert result.completion_tokens > 0 and result.prompt_tokens > 20

    broken = {**call, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    messages[1] = {"role": "assistant", "content": "", "tool_calls": [call, broken]}
    with pytest.raises(loramux.InvalidArgument, match=re.escape("chat.messages[1].tool_calls[1].arguments")):
        client.complete(messages=messages, tools=[WEATHER], max_tokens=4)


def test_message_and_tool_keys_are_checked_before_sending():
    with loramux.Client(worker=UNREACHABLE, timeout=1) as client:
        with pytest.raises(ValueError, match=r"messages\[0\] has unknown keys \['contents'\]"):
            client.generate(messages=[{"role": "user", "contents": "hi"}])
        goes_with_messages = (
            "tools, chat_template_kwargs, continue_final_message and add_generation_prompt go with"
        )
        with pytest.raises(ValueError, match=goes_with_messages):
            client.generate("hi", tools=[WEATHER])
        with pytest.raises(ValueError, match=goes_with_messages):
            client.generate(token_ids=[1], chat_template_kwargs={"enable_thinking": False})
        with pytest.raises(ValueError, match=goes_with_messages):
            client.generate("The sky is", continue_final_message=True)
        with pytest.raises(ValueError, match=goes_with_messages):
            client.generate("The sky is", add_generation_prompt=False)
        with pytest.raises(ValueError, match=r"tools\[0\]\.function has unknown keys \['params'\]"):
            client.generate(messages=[("user", "hi")], tools=[{"function": {"name": "f", "params": {}}}])
        with pytest.raises(ValueError, match="needs 'role' and 'content'"):
            client.generate(messages=[{"role": "tool", "tool_call_id": "call_1"}])


def test_the_default_model_has_no_tool_call_format(client):
    info = client.model_info()
    assert (info.model_name, info.tool_call_format, info.tool_call_token_id) == (
        "SmolLM2-135M-Instruct",
        "",
        None,
    )


def test_cli_constraint_flags_shape_the_printed_output(default_worker, capsys):
    flags = ["--worker", default_worker.address, "--api-token", API_TOKEN, "generate", "--seed", "5"]
    choice = ["--choice", "yes", "--choice", "no", "--temperature", "1"]
    assert cli.run([*flags, *choice, "Is the sky blue?"], {}) == 0
    printed = capsys.readouterr()
    assert printed.out in ("yes\n", "no\n") and "finish: stop" in printed.err

    assert cli.run([*flags, "--regex", REGEX, "--max-tokens", "20", "Code:"], {}) == 0
    printed = capsys.readouterr().out
    assert re.fullmatch(REGEX, printed.removesuffix("\n")), printed


def test_cli_takes_one_constraint_flag_and_reads_files(default_worker, tmp_path, capsys):
    flags = ["--worker", default_worker.address, "--api-token", API_TOKEN, "generate"]
    with pytest.raises(SystemExit) as usage:
        cli.run([*flags, "--regex", "a+", "--choice", "yes", "hi"], {})
    assert usage.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli.run([*flags, "--json-schema", f"@{tmp_path / 'missing.json'}", "hi"], {})
    assert usage.value.code == 2 and "missing.json" in capsys.readouterr().err

    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    from_file = ["--json-schema", f"@{tmp_path / 'schema.json'}", "--max-tokens", "40", "--seed", "2"]
    assert cli.run([*flags, *from_file, "A JSON object:"], {}) == 0
    assert _fits_schema(capsys.readouterr().out)
