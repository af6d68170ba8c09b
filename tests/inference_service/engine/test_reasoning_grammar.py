"""A constraint held after a thinking model's reasoning block (Structured.after_reasoning, which the
worker sets on chat requests to a template with one, unless --constrain-reasoning): the block's text
is free until the first </think>, then the constraint holds the rest, whatever its kind. Compiled
by the worker's grammar engine on the default model's tokenizer; checked against texts, and against
what decoding random logits under its masks writes. The worker's side: which requests get it."""

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as TextTokenizer

from inference_service.engine.grammars import Grammars, mask_rows
from inference_service.engine.tokenizer import Tokenizer
from inference_service.sampling import Structured
from inference_service.server import convert
from shared.errors import InvalidArgument
from shared.pb.loramux.inference.v1 import inference_pb2 as pb

TEMPLATES = Path(__file__).parents[2]
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# Each kind of constraint, and an answer it takes.
CONSTRAINTS = {
    "json_schema": (Structured("json_schema", json.dumps(SMALL)), '{"ok":true,"n":3}'),
    "json_object": (Structured("json_object"), '{"sky":"blue"}'),
    "regex": (Structured("regex", r"Blue, [a-z]{4}"), "Blue, skys"),
    "choice": (Structured("choice", choices=("yes", "no")), "no"),
    "lark": (Structured("grammar", 'start: "n=" NUMBER\nNUMBER: /[0-9]+/\n'), "n=42"),
    "gbnf": (Structured("grammar", 'root ::= "n=" [0-9]+'), "n=7"),
}


@pytest.fixture(scope="module")
def text_tokenizer(default_model_dir) -> TextTokenizer:
    return TextTokenizer.from_file(str(default_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(default_model_dir, text_tokenizer):
    grammars = Grammars(
        default_model_dir / "tokenizer.json", text_tokenizer.get_vocab_size(), (2,), timeout_s=60
    )
    yield grammars
    grammars.close()


def held(kind: str, after_reasoning: str) -> Structured:
    structured, _ = CONSTRAINTS[kind]
    return Structured(structured.kind, structured.spec, structured.choices, after_reasoning)


def takes(grammars: Grammars, text_tokenizer: TextTokenizer, structured: Structured, text: str) -> bool:
    """Whether the constraint takes the whole of `text` and may end there."""
    m = grammars.matcher(structured)
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize(
    "after_reasoning, reply, taken",
    [
        # the prompt opened the block: any text, a constraint's opening and a call's tag included,
        # until </think>; then the answer
        ("think_opened", "Let me see: {not json}, <tool_call>, <think>.\n</think>\n\nANSWER", True),
        ("think_opened", "Short.</think>ANSWER", True),
        ("think_opened", "ANSWER", False),  # the answer is still reasoning: the block never closed
        ("think_opened", "Hm.</think>\n\nnot the answer", False),
        ("think_opened", "Hm.</think>ANSWER</think>", False),  # the first </think> closes the block
        ("think_opened", "Hm.</think>\r\n\r\nANSWER", True),
        ("think_opened", "Hm.</think>\n\n\n\n\nANSWER", False),  # a blank line's space, no run to stall in
        ("think_opened", "Hm.</think>\u3000ANSWER", False),
        # the reply may open a block itself, or answer at once
        ("think", "ANSWER", True),
        ("think", "<think>\nIs it ANSWER?\n</think>\n\nANSWER", True),
        ("think", "\n<think>Hm.</think>ANSWER", False),  # only space after the block, not before it
        ("think", "Hm.</think>ANSWER", False),  # a block the reply did not open
        ("think", "<think>Hm.</think> so </think>ANSWER", False),
        # without: the constraint holds the whole reply (a worker with --constrain-reasoning)
        ("", "ANSWER", True),
        ("", "<think>Hm.</think>ANSWER", False),
    ],
)
def test_the_block_is_free_until_it_closes_and_the_constraint_holds_what_follows(
    grammars, text_tokenizer, kind, after_reasoning, reply, taken
):
    answer = CONSTRAINTS[kind][1]
    assert (
        takes(grammars, text_tokenizer, held(kind, after_reasoning), reply.replace("ANSWER", answer)) == taken
    )


@pytest.mark.parametrize("seed", range(3))
def test_decoding_under_its_masks_after_the_block_writes_what_the_schema_takes(
    grammars, text_tokenizer, seed
):
    """Random logits stand for a model that knows no schema: once its reasoning closes, the masks
    leave it only JSON the schema takes, and the grammar ends the reply."""
    m = grammars.matcher(held("json_schema", "think_opened"))
    assert m.consume_tokens(text_tokenizer.encode("I should say n is 3.</think>\n").ids)
    generator = torch.Generator().manual_seed(seed)
    ids = []
    while not m.is_stopped() and len(ids) < 100:
        logits = torch.randn(1, text_tokenizer.get_vocab_size(), generator=generator)  # [1, vocab]
        token = int(mask_rows(logits, [m]).argmax())
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    answer = text_tokenizer.decode([i for i in ids if i != 2])
    jsonschema.validate(json.loads(answer), SMALL)


def test_a_reasoning_format_it_does_not_know_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="after_reasoning 'thinking' is none of '', 'think'"):
        Structured("json_object", after_reasoning="thinking")


@pytest.fixture(scope="module")
def opened_tokenizer(default_model_dir, tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("opened")
    shutil.copy(default_model_dir / "tokenizer.json", folder / "tokenizer.json")
    template = (TEMPLATES / "think_opened_chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(folder)


def after_reasoning_of(tokenizer: Tokenizer, constrain_reasoning: bool = False, **given) -> str:
    """What the worker's request conversion sets on a json_object constraint's after_reasoning."""
    sampling = pb.SamplingParams(max_tokens=1, json_object=True)
    message = pb.GenerateRequest(sampling=sampling, **given)
    request = convert.request(message, tokenizer, 1024, "w1", constrain_reasoning)
    return request.params.structured.after_reasoning


CHAT = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Sky?")])


def test_a_chat_requests_constraint_follows_the_templates_reasoning_block(opened_tokenizer, tokenizer):
    """Chat input only: a text or token prompt is the caller's own, whose opened blocks the worker
    cannot know. Not on a template without a block, nor on a worker that constrains reasoning."""
    assert after_reasoning_of(opened_tokenizer, chat=CHAT) == "think_opened"
    assert after_reasoning_of(opened_tokenizer, text="Sky?") == ""
    assert after_reasoning_of(opened_tokenizer, token_ids=pb.TokenIds(ids=[1, 2])) == ""
    assert after_reasoning_of(opened_tokenizer, constrain_reasoning=True, chat=CHAT) == ""
    assert after_reasoning_of(tokenizer, chat=CHAT) == ""  # the default model's template


def test_a_chat_that_opens_no_reply_holds_it_whole(opened_tokenizer):
    """A continued final message goes on as it was, and a prompt without the generation prompt
    opened no block: the constraint holds the reply from its first token."""
    begun = pb.ChatInput(messages=[*CHAT.messages, pb.ChatMessage(role="assistant", content="Blue")])
    begun.continue_final_message = True
    assert after_reasoning_of(opened_tokenizer, chat=begun) == ""
    closed = pb.ChatInput(messages=CHAT.messages, omit_generation_prompt=True)
    assert after_reasoning_of(opened_tokenizer, chat=closed) == ""
