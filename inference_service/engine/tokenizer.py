"""Text <-> token ids and chat prompts for one HF model folder, without transformers.

Reads tokenizer.json with the `tokenizers` library and renders the chat template with jinja2 the
way transformers does, so a prompt built here tokenizes exactly as it would under transformers.
"""

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference_service.engine.final_message import cut_at, marked
from shared.errors import FailedPrecondition, InvalidArgument

# What the Llama 3.1 to 3.3 chat templates tell the model a call of a tool the user gives is.
LLAMA3_JSON_INSTRUCTION = '"parameters": dictionary of argument name and its value'
# What Qwen3-Coder's template shows the model a call is made of, in <tool_call> blocks.
QWEN3_XML_TAGS = ("<tool_call>", "<function=", "<parameter=")
# What GLM-4.5's template shows the model a call is made of: the name, then each argument's tags.
GLM45_TAGS = ("<tool_call>", "<arg_key>", "<arg_value>")
# The variables apply_chat_template sets: a request's own template variables may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
# A thinking model's reasoning block, as Qwen3's and DeepSeek-R1's templates write it.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The special token with which Mistral's models open their calls, a JSON array after it.
MISTRAL_CALLS_TOKEN, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# The call ids Mistral's templates take: nine letters and digits.
MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")


class Tokenizer:
    """One model folder's tokenizer, its special tokens and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        model_dir: Path,
        tokenizer_config: dict,
        model_config: dict,
        chat_template: str | None,
    ):
        self._backend = backend
        self._model_dir = model_dir
        self._bos_token = _token_text(tokenizer_config.get("bos_token"))
        self._eos_token = _token_text(tokenizer_config.get("eos_token"))
        self._bos_token_id = self._id_of(self._bos_token, model_config.get("bos_token_id"))
        self._eos_token_ids = self._eos_ids(model_config.get("eos_token_id"))
        self._template_source = chat_template
        self._template = _compile(chat_template, model_dir) if chat_template else None
        added = backend.get_added_tokens_decoder()
        special = {token.content: i for i, token in added.items() if token.special}  # text -> id
        self._tool_call_format, self._tool_call_token_id = self._tool_calls(special)
        self._reasoning_format = self._reasoning()
        # Special tokens a decode leaves out: all but the one that opens calls, which the gateway reads.
        self._skipped = frozenset(special.values()) - {self._tool_call_token_id}
        pieces = _pieces(backend)
        self._max_token_bytes = _max_token_bytes(pieces)
        self._token_bytes = _token_bytes(backend, pieces)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise InvalidArgument(f"model folder {model_dir} has no tokenizer.json")
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        return cls(
            backend=tokenizers.Tokenizer.from_file(str(path)),
            model_dir=model_dir,
            tokenizer_config=tokenizer_config,
            model_config=_read_json(model_dir / "config.json"),
            chat_template=_chat_template(model_dir, tokenizer_config),
        )

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos token and the model config's eos ids."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for: a text of more than
        n × max_token_bytes bytes tokenizes into more than n tokens."""
        return self._max_token_bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for; the tokens of a text join into its UTF-8 bytes,
        though a token alone may hold part of a character (byte-level and byte-fallback BPE)."""
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. <|im_end|>) stay one token each.

        `add_special_tokens` runs the folder's post-processor (a BOS, for models that want one);
        turn it off for rendered chat prompts, whose template already writes the BOS.
        """
        # encode_batch lets go of the GIL while it works (encode keeps it), so a long text tokenized
        # in a worker thread leaves the event loop and the engine thread running.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`skip_special_tokens` leaves out every special token but the one that opens tool calls
        (tool_call_token_id), which is what the gateway reads calls after."""
        if skip_special_tokens and self._tool_call_token_id is not None:
            token_ids = [i for i in token_ids if i not in self._skipped]
            skip_special_tokens = False
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def tool_call_format(self) -> str:
        """The tool-call format the chat template teaches: "hermes" (<tool_call>{...}</tool_call>,
        as Hermes, Qwen2.5 and Qwen3 write calls), "qwen3_xml" (<tool_call> blocks of
        <function=NAME> and <parameter=KEY> tags, as Qwen3-Coder writes calls), "glm45"
        (<tool_call> blocks of the name, then <arg_key> and <arg_value> tags for each argument, as
        GLM-4.5 to 4.7 write calls), "llama3_json" (the
        whole reply a JSON object {"name": ..., "parameters": {...}}, as Llama 3.1 to 3.3 write
        calls to the tools a user gives), "mistral" (the special token [TOOL_CALLS], then a JSON
        array of {"name": ..., "arguments": {...}} calls, as Mistral's models write them), or ""
        when it teaches none."""
        return self._tool_call_format

    @property
    def tool_call_token_id(self) -> int | None:
        """The special token that opens a reply's calls, in formats that have one (mistral)."""
        return self._tool_call_token_id

    @property
    def reasoning_format(self) -> str:
        """How the chat template has a model reason: "think" (the model opens a <think> block,
        as Qwen3 does), "think_opened" (the generation prompt opens it, as DeepSeek-R1's and
        Qwen3's thinking models' do), or "" (no reasoning block)."""
        return self._reasoning_format

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt for a conversation, as transformers' apply_chat_template(tokenize=False) renders
        it; `tools`: the functions the model may call, as OpenAI's request lists them;
        `template_kwargs`: more variables for the template (transformers' **kwargs);
        `continue_final_message`: the final message left open, the prompt cut where its text ends
        (final_message.py; a generation prompt after it is cut too)."""
        if self._template is None:
            raise FailedPrecondition(f"model folder {self._model_dir} has no chat template")
        _check_messages(messages)
        _check_template_kwargs(template_kwargs or {})
        if self._tool_call_format == "mistral":
            messages = [_with_mistral_ids(message) for message in messages]
        if continue_final_message:
            messages, mark = marked(messages)
        try:
            rendered = self._template.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except TemplateError as e:
            raise InvalidArgument(f"chat template of {self._model_dir} failed on these messages: {e}") from e
        return cut_at(rendered, mark) if continue_final_message else rendered

    def _tool_calls(self, special: dict[str, int]) -> tuple[str, int | None]:
        """(tool_call_format, tool_call_token_id), read from the template and the vocabulary's
        special tokens (text -> id)."""
        source = self._template_source or ""
        if all(tag in source for tag in QWEN3_XML_TAGS):  # before Hermes': its blocks are <tool_call> too
            return "qwen3_xml", None
        if all(tag in source for tag in GLM45_TAGS):  # so are GLM-4.5's
            return "glm45", None
        if "<tool_call>" in source:
            return "hermes", None
        if LLAMA3_JSON_INSTRUCTION in source:
            return "llama3_json", None
        # Mistral's later templates write a call as [TOOL_CALLS]name[ARGS]{...}: a format not read here
        if MISTRAL_CALLS_TOKEN in source and MISTRAL_ARGS not in source and MISTRAL_CALLS_TOKEN in special:
            return "mistral", special[MISTRAL_CALLS_TOKEN]
        return "", None

    def _reasoning(self) -> str:
        """Read from the template, and from the generation prompt it renders for one question."""
        if THINK_CLOSE not in (self._template_source or ""):
            return ""
        try:
            prompt = self.apply_chat_template([{"role": "user", "content": "?"}])
        except InvalidArgument:  # a template that refuses the probe: the model may still open a block
            return "think"
        return "think_opened" if prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE) else "think"

    def _id_of(self, token: str | None, fallback: int | None) -> int | None:
        token_id = self._backend.token_to_id(token) if token is not None else None
        return fallback if token_id is None else token_id

    def _eos_ids(self, config_eos: int | list[int] | None) -> tuple[int, ...]:
        config_ids = config_eos if isinstance(config_eos, list) else [config_eos]
        ids = [self._id_of(self._eos_token, None), *config_ids]
        return tuple(dict.fromkeys(i for i in ids if i is not None))  # dedupe, keep order


def _with_mistral_ids(message: dict) -> dict:
    """The message with its call ids as Mistral's templates take them, nine letters and digits:
    an id that is not becomes the first nine hex digits of its SHA-256, the same in the call and
    in the tool's answer to it."""
    message = dict(message)
    if "tool_call_id" in message:
        message["tool_call_id"] = _mistral_id(message["tool_call_id"])
    if message.get("tool_calls"):
        message["tool_calls"] = [{**call, "id": _mistral_id(call["id"])} for call in message["tool_calls"]]
    return message


def _mistral_id(call_id: str) -> str:
    if MISTRAL_CALL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _pieces(backend: tokenizers.Tokenizer) -> list[str]:
    """Every token decoded alone, special tokens included."""
    size = backend.get_vocab_size(with_added_tokens=True)
    return backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)


def _max_token_bytes(pieces: list[str]) -> int:
    """A token decodes to the bytes it covers; + 1 for the leading space a decoder drops from a
    token decoded alone (SentencePiece's ▁). A byte-fallback or partial-character token decodes
    to U+FFFD (3 bytes), more than the bytes it covers, so the bound only errs high. Not so for a
    normalizer that composes characters (Qwen2's NFC): decomposed text (Hangul jamo) shrinks up to
    3x before tokenizing, so such a prompt near max_model_len may be refused though it would fit."""
    return max((len(p.encode("utf-8")) for p in pieces), default=0) + 1


def _token_bytes(backend: tokenizers.Tokenizer, pieces: list[str]) -> list[bytes]:
    """Each token's own bytes. Decoding a token alone turns a partial character into U+FFFD, so
    the bytes come from the vocabulary's spelling where the decoder says how to read it: byte-level
    BPE spells each byte as one character (GPT-2's table); SentencePiece with byte fallback spells
    bytes as <0xNN> and spaces as ▁. Added (special) tokens are their own text."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = [d.get("type") for d in decoder.get("decoders", [])] or [decoder.get("type")]
    added = backend.get_added_tokens_decoder()
    spell = [backend.id_to_token(i) for i in range(len(pieces))]
    if "ByteLevel" in steps:
        byte_of = {ch: b for b, ch in enumerate(_byte_level_alphabet())}
        read = lambda token: bytes(byte_of[ch] for ch in token)  # noqa: E731
    elif "ByteFallback" in steps:
        read = _byte_fallback_bytes
    else:
        read = None
    return [
        piece.encode("utf-8") if read is None or i in added or token is None else read(token)
        for i, (token, piece) in enumerate(zip(spell, pieces, strict=True))
    ]


def _byte_level_alphabet() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's bytes_to_unicode):
    printable Latin-1 bytes as themselves, the others as characters from U+0100 on, in order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _byte_fallback_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode("utf-8")


def _read_json(path: Path) -> dict:
    """A folder's optional JSON file, or {} when it is absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{path} is not valid JSON: {e}") from e


def _token_text(token: str | dict | None) -> str | None:
    """Older tokenizer_config.json files spell special tokens as serialized AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja wins, as in transformers; else tokenizer_config's template (or its "default")."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def _compile(source: str, model_dir: Path) -> Template:
    # Templates ship with checkpoints from anywhere: sandboxed, and immutable so they cannot edit
    # the caller's messages. The options are transformers' own, which templates are written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise InvalidArgument(f"chat template of {model_dir} does not parse: {e}") from e


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: plain JSON (jinja2's own escapes <, > and & for HTML), with options
    templates pass, such as indent."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    """Templates call this to reject a conversation (e.g. roles that do not alternate)."""
    raise InvalidArgument(f"chat template rejected the messages: {message}")


def _check_template_kwargs(kwargs: dict) -> None:
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgument(f"chat template variable {name!r} is not a name")
        if name in TEMPLATE_VARIABLES:
            raise InvalidArgument(f"chat template variable {name!r} is set by the worker, not the request")


def _check_messages(messages) -> None:
    if not isinstance(messages, list):
        raise InvalidArgument(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidArgument(f"messages[{i}][{key!r}] must be a string")
