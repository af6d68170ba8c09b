"""SamplingParams: what one request asks of the sampler, validated when built. The batched sampler
that applies them lives in engine/sampler.py."""

import math
import reprlib
from dataclasses import dataclass

from shared.errors import InvalidArgument
from shared.structured_limit import MAX_STRUCTURED_CHARS

MAX_LOGPROBS = 20
# Temperatures below this are greedy: dividing by them can overflow the logits to inf (as vLLM does).
GREEDY_BELOW = 1e-5
# Stop strings are matched against each request's new text inside the engine step every request
# shares, so their number and length are bounded: 16 holds the end-of-turn markers of any chat
# template several times over (OpenAI's API takes 4), 256 characters any delimiter a person writes,
# and the text held back while a stop string may be starting stays under 256 characters.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Each generated token is looked up in stop_token_ids; 64 ids hold every end-of-turn token of any
# tokenizer with room to spare.
MAX_STOP_TOKEN_IDS = 64
# Tokens one request may bias: a classifier's labels or a list of banned words, not the vocabulary.
MAX_LOGIT_BIAS = 1024
# A constraint is compiled when its request is submitted: its text and its choices are bounded.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 256
# A thinking model's reasoning block, which a constraint may follow (Tokenizer.reasoning_format):
# none, one the reply may open, one the prompt opened.
REASONING_FORMATS = ("", "think", "think_opened")


@dataclass(frozen=True)
class Structured:
    """One constraint on a request's output: a JSON schema (its JSON text), any JSON object, a
    regex, one of `choices`, or a grammar (Lark, or GBNF with ::= rules). The engine compiles it
    when the request is submitted (engine/grammars.py) and samples only tokens it allows.
    `after_reasoning`: a reasoning block of that format comes first, its text free until </think>
    ("think": where the reply opens one; "think_opened": the prompt opened it), and the constraint
    holds what follows it."""

    kind: str
    spec: str = ""  # the schema, regex or grammar; "" for json_object and choice
    choices: tuple[str, ...] = ()
    after_reasoning: str = ""  # one of REASONING_FORMATS

    def __post_init__(self):
        object.__setattr__(self, "choices", _as_tuple(self.choices, "structured.choices"))
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidArgument(
                f"structured output kind {reprlib.repr(self.kind)} is none of {', '.join(STRUCTURED_KINDS)}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_CHARS:
            raise InvalidArgument(
                f"structured output {self.kind} must be a string of at most {MAX_STRUCTURED_CHARS} characters"
            )
        if (self.kind in ("json_object", "choice")) == bool(self.spec):
            raise InvalidArgument(
                f"structured output {self.kind} {'takes no' if self.spec else 'needs a'} text"
            )
        if (self.kind == "choice") != bool(self.choices):
            raise InvalidArgument(
                "structured output choices go with kind 'choice', and it needs at least one"
            )
        if len(self.choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choices):
            raise InvalidArgument(
                f"structured output choices must be at most {MAX_CHOICES} non-empty strings"
            )
        if sum(len(c) for c in self.choices) > MAX_STRUCTURED_CHARS:
            raise InvalidArgument(
                f"structured output choices hold more than {MAX_STRUCTURED_CHARS} characters"
            )
        if self.after_reasoning not in REASONING_FORMATS:
            raise InvalidArgument(
                f"structured output after_reasoning {reprlib.repr(self.after_reasoning)} is none of "
                + ", ".join(map(repr, REASONING_FORMATS))
            )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # no EOS, stop_token_ids or stop string ends the output before it holds this many
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    repetition_penalty: float = 1.0  # applies to every token of the prompt and the output so far
    presence_penalty: float = 0.0  # subtracted from the logit of each token in the output so far
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), before any penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The output's text: special tokens left out (a tool-call format's opening one aside), and a
    # stop string that ends it left out too unless include_stop_str_in_output (vLLM's options)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int = 0  # how many top logprobs to return per token
    structured: Structured | None = None  # a constraint the output follows

    def __post_init__(self):
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _as_tuple(self.logit_bias, "logit_bias"))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(
                f"sampling parameter logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}"
            )
        _check_stop_sizes(self.stop, self.stop_token_ids)
        if self.min_tokens and self.structured is not None:
            raise InvalidArgument(
                "sampling parameter min_tokens cannot go with an output constraint: the constraint "
                "ends the output where it is whole"
            )
        for name, (valid, allowed) in _CHECKS.items():
            value = getattr(self, name)
            if not valid(value):  # reprlib: a client's value is quoted short, never whole
                got = reprlib.repr(value)
                raise InvalidArgument(f"sampling parameter {name} must be {allowed}, got {got}")


_CHECKS = {  # field: (is the value valid, what is allowed)
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "min_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "temperature": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "0 (off) or an integer >= 1"),
    "top_p": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _is_real(v) and v > 0, "a finite number > 0"),
    "presence_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "logit_bias": (
        lambda v: all(_is_bias(pair) for pair in v) and len({token for token, _ in v}) == len(v),
        "(token id >= 0, bias in [-100, 100]) pairs, each token once",
    ),
    "seed": (lambda v: v is None or (_is_int(v) and 0 <= v < 2**64), "None or an integer in [0, 2**64)"),
    "stop": (lambda v: all(isinstance(s, str) and s for s in v), "a list of non-empty strings"),
    "stop_token_ids": (lambda v: all(_is_int(i) and i >= 0 for i in v), "a list of integers >= 0"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "a bool"),
    "logprobs": (lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in 0..{MAX_LOGPROBS}"),
    "structured": (lambda v: v is None or isinstance(v, Structured), "None or a Structured"),
}


def _is_bias(pair: object) -> bool:
    return (
        isinstance(pair, tuple | list)
        and len(pair) == 2
        and _is_int(pair[0])
        and pair[0] >= 0
        and _is_real(pair[1])
        and -100 <= pair[1] <= 100
    )


def _as_tuple(value: object, name: str) -> tuple:
    if not isinstance(value, list | tuple):  # a bare string would otherwise become its characters
        raise InvalidArgument(f"sampling parameter {name} must be a list, got {reprlib.repr(value)}")
    return tuple(value)


def _check_stop_sizes(stop: tuple, stop_token_ids: tuple) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling parameter stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            f"sampling parameter stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
        )
    for i, s in enumerate(stop):
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(
                f"sampling parameter stop[{i}] is {len(s)} characters long; at most {MAX_STOP_CHARS}"
            )
