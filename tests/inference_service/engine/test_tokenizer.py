"""Our tokenizer on the default model's folder against transformers' tokenizer read from the same GGUF."""

import hashlib
import json
import shutil
import unicodedata
from pathlib import Path

import pytest

from inference_service.default_model import find_gguf
from inference_service.engine.tokenizer import Tokenizer
from shared.errors import FailedPrecondition, InvalidArgument
from tests.conftest import MISTRAL_CALLS_ID, with_mistral_calls_token

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14",
    "It's 2024-11-21, isn't it? They'll say we've won.",
    "café naïve 日本語 🚀",
    "a  b   c    d\t\te",
    "  leading and trailing   ",
    "line one\nline two\n\n\nline five\r\n",
    'def add(x, y):\n    """Sum."""\n    return x + y  # 1 line\n',
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
# Numbers after a run of two or more blanks. llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own
# tokenizer.json) cut every \p{N} character out before the GPT-2 regex runs, so the blanks stay one
# piece. transformers' GGUF loader has no "smollm" entry and runs the GPT-2 regex alone, which
# splits "\n    1" into "\n   " + " 1": it differs from llama.cpp on exactly these strings.
NUMBERS_AFTER_BLANKS = [
    "  1",
    "x = [\n    1,\n    2,\n]",
    "\n\n42",
    "total:   ½ of ٣",
]


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer built from the GGUF metadata, the reference for vocab, merges and template."""
    transformers = pytest.importorskip("transformers")
    path = find_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def split_numbers(text: str) -> list[str]:
    """Text cut around every Unicode number character, as llama.cpp's first smollm regex (\\p{N}) does."""
    pieces, current = [], ""
    for char in text:
        if unicodedata.category(char).startswith("N"):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return [*pieces, current] if current else pieces


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", NUMBERS_AFTER_BLANKS)
def test_numbers_are_split_off_before_bpe(tokenizer, reference, text):
    expected = [token for piece in split_numbers(text) for token in reference.encode(piece)]
    assert tokenizer.encode(text) == expected


def test_indentation_before_a_number_is_one_token(tokenizer):
    assert tokenizer.encode("[\n    1") == tokenizer.encode("[\n    ") + tokenizer.encode("1")
    assert len(tokenizer.encode("\n    ")) == 1


@pytest.mark.parametrize("text", TEXTS + NUMBERS_AFTER_BLANKS)
def test_decode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_stay_whole(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert (ids[0], ids[-1]) == (1, 2)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_ids_and_vocab_size(tokenizer, reference):
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert tokenizer.vocab_size == len(reference) == 49152


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "What is 2+2?"}],
    ],
    ids=["system+user", "user-only"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tokenizer, reference, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_missing_tokenizer_json_names_the_folder(tmp_path):
    with pytest.raises(InvalidArgument, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_folder_without_chat_template_names_the_folder(default_model_dir, tmp_path):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.encode("hello") == Tokenizer.from_dir(default_model_dir).encode("hello")
    with pytest.raises(FailedPrecondition, match=str(tmp_path)):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_templates_use_the_default_one(default_model_dir, tmp_path):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "[user]hi"


def test_template_raise_exception_is_invalid_argument(default_model_dir, tmp_path):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(InvalidArgument, match="first must be user"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(
    "messages",
    [
        "hi",
        {"role": "user", "content": "hi"},
        [("user", "hi")],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": 1, "content": "hi"}],
    ],
)
def test_malformed_messages_are_invalid_argument(tokenizer, messages):
    with pytest.raises(InvalidArgument):
        tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("text", TEXTS + NUMBERS_AFTER_BLANKS)
def test_token_bytes_join_into_the_text(tokenizer, text):
    """Byte-level BPE: a token may hold part of a character (🚀 is several tokens), and its bytes are
    those bytes, not the U+FFFD it decodes to alone."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_of_a_byte_fallback_tokenizer(tmp_path):
    """SentencePiece-style (Llama 2, Mistral): ▁ for spaces, <0xNN> tokens for bytes the vocabulary lacks."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁": 256, "a": 257, "b": 258, "▁a": 259, "▁ab": 260}
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, [("▁", "a"), ("▁a", "b")], byte_fallback=True)
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode("ab a 🚀", add_special_tokens=False)
    assert [tokenizer.token_bytes(i) for i in ids] == [
        b" ab",
        b" a",
        b" ",
        b"\xf0",
        b"\x9f",
        b"\x9a",
        b"\x80",
    ]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <today> & tomorrow.",  # tojson must not HTML-escape
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {}}},
]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


# Test templates in the style of four families': the format each teaches, what shows the tools
# are there, and how an earlier call renders.
TOOL_TEMPLATES = {
    "hermes_chat_template.jinja": ("hermes", "<tools>", '"arguments": {"city": "Zürich"}'),
    "qwen3_xml_chat_template.jinja": (
        "qwen3_xml",
        "<tools>",
        "<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>",
    ),
    "glm45_chat_template.jinja": (
        "glm45",
        "<tools>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n</tool_call>",
    ),
    "llama3_chat_template.jinja": (
        "llama3_json",
        "Given the following functions",
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
    ),
}


@pytest.mark.parametrize("template_file", list(TOOL_TEMPLATES))
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_tools_calls_and_results_render_as_transformers_renders_them(
    default_model_dir, tmp_path, reference, tools, template_file
):
    tool_format, shows_tools, earlier_call = TOOL_TEMPLATES[template_file]
    template = (Path(__file__).parents[2] / template_file).read_text()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the special tokens: Llama's opens with BOS
        shutil.copy(default_model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_dir(tmp_path)
    ours = tokenizer.apply_chat_template(TOOL_CHAT, tools=tools)
    theirs = reference.apply_chat_template(
        TOOL_CHAT, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert (shows_tools in ours) == bool(tools) and earlier_call in ours
    assert tokenizer.tool_call_format == tool_format


def test_a_template_without_tool_calls_teaches_no_format(tokenizer):
    assert tokenizer.tool_call_format == ""


@pytest.fixture
def mistral_dir(default_model_dir, tmp_path) -> Path:
    """The default tokenizer with [TOOL_CALLS] one of its special tokens, and the Mistral-style
    test template."""
    tokenizer_json = (default_model_dir / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(with_mistral_calls_token(tokenizer_json))
    shutil.copy(default_model_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    template = (Path(__file__).parents[2] / "mistral_chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def test_a_mistral_template_over_its_call_token_teaches_the_mistral_format(mistral_dir):
    tokenizer = Tokenizer.from_dir(mistral_dir)
    assert (tokenizer.tool_call_format, tokenizer.tool_call_token_id) == ("mistral", MISTRAL_CALLS_ID)


def test_a_mistral_template_of_name_and_args_calls_teaches_no_format_read_here(mistral_dir):
    """Mistral's later templates write [TOOL_CALLS]name[ARGS]{...}, not the array this reads."""
    template = (mistral_dir / "chat_template.jinja").read_text()
    (mistral_dir / "chat_template.jinja").write_text(template + "{{- '[TOOL_CALLS]' + 'f' + '[ARGS]' }}")
    assert Tokenizer.from_dir(mistral_dir).tool_call_format == ""


def test_without_the_call_token_a_mistral_template_teaches_no_format(mistral_dir, default_model_dir):
    """Calls are read after the special token; a vocabulary without it cannot open them."""
    shutil.copy(default_model_dir / "tokenizer.json", mistral_dir / "tokenizer.json")
    tokenizer = Tokenizer.from_dir(mistral_dir)
    assert (tokenizer.tool_call_format, tokenizer.tool_call_token_id) == ("", None)


def test_the_call_token_under_a_template_that_does_not_teach_it_is_left_out(mistral_dir):
    """A vocabulary that has the token, under a template that teaches no calls after it."""
    (mistral_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer = Tokenizer.from_dir(mistral_dir)
    assert (tokenizer.tool_call_format, tokenizer.tool_call_token_id) == ("", None)
    ids = tokenizer.encode("a[TOOL_CALLS]b", add_special_tokens=False)
    assert MISTRAL_CALLS_ID in ids and tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_a_decode_keeps_the_call_token_and_leaves_out_the_other_special_tokens(mistral_dir):
    spec = json.loads((mistral_dir / "tokenizer.json").read_text())
    [reponame] = [t for t in spec["added_tokens"] if t["content"] == "<reponame>"]
    reponame["special"] = False  # an added token that is not special: text, kept as any decode keeps it
    (mistral_dir / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_dir(mistral_dir)
    kept = tokenizer.encode("a<reponame>b", add_special_tokens=False)
    assert tokenizer.decode(kept, skip_special_tokens=True) == "a<reponame>b"
    calls = '[{"name": "now", "arguments": {}}]'
    ids = tokenizer.encode("Sure.[TOOL_CALLS] " + calls + "<|im_end|>", add_special_tokens=False)
    assert MISTRAL_CALLS_ID in ids and 2 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Sure.[TOOL_CALLS] " + calls
    assert tokenizer.decode(ids) == "Sure.[TOOL_CALLS] " + calls + "<|im_end|>"


def test_other_formats_leave_out_every_special_token(tokenizer):
    ids = tokenizer.encode("a<file_sep>b<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_mistral_call_ids_become_nine_characters_as_its_templates_take_them(mistral_dir, reference):
    """Mistral's templates refuse ids other than nine letters and digits, which OpenAI's ids
    (call_...) are not: each becomes the first nine hex digits of its SHA-256, in the call and in
    the tool's answer alike; an id of nine already stays."""
    tokenizer = Tokenizer.from_dir(mistral_dir)
    template = (mistral_dir / "chat_template.jinja").read_text()
    render = lambda chat: reference.apply_chat_template(  # noqa: E731
        chat, tools=TOOLS, chat_template=template, tokenize=False
    )
    with pytest.raises(Exception, match="nine letters and digits"):
        render(TOOL_CHAT)
    short = hashlib.sha256(b"call_1").hexdigest()[:9]
    ours = tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS)
    assert ours == render(_with_call_id(TOOL_CHAT, short))
    assert "[AVAILABLE_TOOLS]" in ours and f'"id": "{short}"' in ours and f'"call_id": "{short}"' in ours
    kept = _with_call_id(TOOL_CHAT, "Ab3dE6gH9")
    assert tokenizer.apply_chat_template(kept, tools=TOOLS) == render(kept)


def _with_call_id(chat: list[dict], call_id: str) -> list[dict]:
    """The chat with its one call's id, and its tool answer's, replaced."""
    replaced = []
    for message in chat:
        if message.get("tool_calls"):
            [call] = message["tool_calls"]
            message = {**message, "tool_calls": [{**call, "id": call_id}]}
        elif message["role"] == "tool":
            message = {**message, "tool_call_id": call_id}
        replaced.append(message)
    return replaced


@pytest.mark.parametrize(
    "template_file, reasoning_format",
    [
        ("think_chat_template.jinja", "think"),
        ("think_opened_chat_template.jinja", "think_opened"),
        ("hermes_chat_template.jinja", ""),
    ],
)
def test_the_reasoning_format_is_read_from_the_template_and_its_generation_prompt(
    default_model_dir, tmp_path, template_file, reasoning_format
):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text((Path(__file__).parents[2] / template_file).read_text())
    assert Tokenizer.from_dir(tmp_path).reasoning_format == reasoning_format


def test_a_think_template_that_refuses_the_probe_still_lets_the_model_open_a_block(
    default_model_dir, tmp_path
):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    refusing = "{{ raise_exception('no') if messages[0].content == '?' }}</think>"
    (tmp_path / "chat_template.jinja").write_text(refusing)
    assert Tokenizer.from_dir(tmp_path).reasoning_format == "think"


def test_the_default_model_has_no_reasoning_format(tokenizer):
    assert tokenizer.reasoning_format == ""


def test_template_kwargs_reach_the_template_and_may_not_replace_its_own(default_model_dir, tmp_path):
    """As transformers' **kwargs: Qwen3's enable_thinking=False closes an empty block for the model."""
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (Path(__file__).parents[2] / "think_chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_dir(tmp_path)
    chat = [{"role": "user", "content": "Sky?"}]
    thinking = tokenizer.apply_chat_template(chat)
    assert thinking.endswith("<|im_start|>assistant\n")
    closed = tokenizer.apply_chat_template(chat, template_kwargs={"enable_thinking": False})
    assert closed == thinking + "<think>\n\n</think>\n\n"
    for name in ("messages", "add_generation_prompt", "bos_token"):
        with pytest.raises(InvalidArgument, match=f"variable '{name}' is set by the worker"):
            tokenizer.apply_chat_template(chat, template_kwargs={name: []})
    with pytest.raises(InvalidArgument, match="variable 'not a name' is not a name"):
        tokenizer.apply_chat_template(chat, template_kwargs={"not a name": 1})


# A template that trims each message's text, as Llama 3's do.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("template_file", ["default", "trimming", "hermes_chat_template.jinja"])
@pytest.mark.parametrize("answer", ["The sky is", "The sky is ", "Sky:\n- blue\n"])
def test_a_continued_final_message_renders_as_transformers_renders_it(
    default_model_dir, tmp_path, reference, template_file, answer
):
    """The prompt ends where the answer begun for the model ends (its space trimmed where the
    template trims it), with no end of turn and no generation prompt after it."""
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    templates = {
        "default": (default_model_dir / "chat_template.jinja").read_text(),
        "trimming": TRIMMING_TEMPLATE,
    }
    template = templates.get(template_file) or (Path(__file__).parents[2] / template_file).read_text()
    (tmp_path / "chat_template.jinja").write_text(template)
    chat = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": answer}]
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(chat, continue_final_message=True)
    theirs = reference.apply_chat_template(
        chat, chat_template=template, tokenize=False, continue_final_message=True
    )
    assert ours == theirs
    assert ours.endswith(answer.rstrip() if template_file == "trimming" else answer)


def test_a_final_message_the_template_leaves_out_cannot_be_continued(default_model_dir, tmp_path):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    )
    chat = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue"}]
    with pytest.raises(InvalidArgument, match="leaves out the end of the final message"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(chat, continue_final_message=True)
    with pytest.raises(InvalidArgument, match="needs a final message to continue"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([], continue_final_message=True)
