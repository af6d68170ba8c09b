"""Grammars: turns a request's output constraint (sampling.Structured) into a matcher of the grammar
engine (llguidance), which says at each step which tokens may come next and follows the tokens
drawn. A constraint is compiled once per engine (its grammar text validated against the model's
tokenizer, kept in a bounded cache keyed by the constraint) and each request gets a matcher of
its own. Compiling happens where the request is submitted, never in the step; requests may be
submitted from several threads at once."""

import json
import re
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from inference_service.sampling import Structured
from shared.errors import InvalidArgument

CACHE_SIZE = 256  # compiled constraints kept


class Grammars:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """tokenizer_json: the model's tokenizer; vocab_size: the logits' width (the model's)."""
        self._source = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Structured, str] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the tokenizer's first build
        self.compiles = self.hits = 0

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first constraint (a fifth of a second on a 49k vocabulary), not with
        every engine."""
        if self._llg_tokenizer is None:
            path, vocab_size, eos = self._source
            self._llg_tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=eos)
        return self._llg_tokenizer

    def matcher(self, structured: Structured) -> llguidance.LLMatcher:
        """A new matcher at the start of `structured`'s output; InvalidArgument naming what is wrong
        with a constraint the grammar engine refuses."""
        with self._lock:
            grammar = self._cached(structured)
            tokenizer = self._tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidArgument(f"structured output {structured.kind}: {matcher.get_error()}")
        return matcher

    def _cached(self, structured: Structured) -> str:
        """The constraint's grammar, compiled now or found in the cache (under the lock)."""
        grammar = self._compiled.get(structured)
        if grammar is None:
            grammar = self._compile(structured)
            self._compiled[structured] = grammar
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self.hits += 1
            self._compiled.move_to_end(structured)
        return grammar

    def _compile(self, structured: Structured) -> str:
        self.compiles += 1
        try:
            grammar = _grammar(structured)
        except Exception as e:  # the grammar engine's refusals: its GBNF reader raises bare Exception
            raise InvalidArgument(f"structured output {structured.kind}: {e}") from None
        # (is_error, messages): an error, or warnings such as a schema keyword the engine would
        # otherwise leave unenforced; either refuses the constraint (a strict schema holds whole)
        _, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if problems:
            raise InvalidArgument(f"structured output {structured.kind}: {'; '.join(problems)}")
        return grammar


def _grammar(structured: Structured) -> str:
    kind, spec = structured.kind, structured.spec
    compact = {"whitespace_flexible": False}  # no free whitespace runs: compact JSON
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if kind == "json_schema":
        try:
            json.loads(spec)
        except ValueError as e:
            raise ValueError(f"the schema is not JSON ({e})") from None
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=compact)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in structured.choices))
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))  # GBNF (::= rules) or Lark


def mask_rows(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [rows, vocab] with every token row i's matcher forbids at -inf (a copy when any
    row is constrained; matchers[i] None: row i is left as it is). The matchers write their
    bitmasks (bit k of word w: token 32 w + k may come) straight into a tensor; llguidance's own
    torch helpers are not used, as they torch.compile at import and at their first call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [c, words]
    for j, i in enumerate(rows):
        matchers[i].unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [c, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool().to(logits.device)  # [c, vocab]
    masked = logits.clone()
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked
