"""Grammars: turns a request's output constraint (sampling.Structured) into a matcher of the grammar
engine (llguidance), which says at each step which tokens may come next and follows the tokens
drawn. A constraint is compiled once per engine, on a compile thread (GBNF on threads of its own,
as its reads wait on a child process): its grammar text validated against the model's tokenizer,
a matcher built and its first mask computed (which builds the lexer states), and kept in a bounded
cache keyed by the constraint; each request gets a copy of that matcher. A caller waits at most
`timeout_s` for a compile (the compile itself goes on and is cached), and never holds a lock while
it waits, so one slow constraint delays only its own requests; an event loop waits without holding
a thread (matcher_async). Requests may be submitted from several threads at once; the step thread
never compiles."""

import asyncio
import json
import re
import subprocess
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as CompileTimeout
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from inference_service.engine.deep_stack_threads import DeepStackThreads
from inference_service.engine.histogram import Histogram
from inference_service.engine.tokenizer import THINK_CLOSE, THINK_OPEN
from inference_service.sampling import Structured
from kernels.cpu_token_mask import CpuTokenMask
from shared.child_script import ScriptFailed, run_script
from shared.errors import InvalidArgument

CACHE_SIZE = 256  # compiled constraints kept
COMPILE_THREADS = 2  # the grammar engine drops the GIL while it compiles: steps go on beside it
# GBNF compiles on threads of their own: each waits on its reader's child (below) up to the compile
# timeout, and two slow reads on the compile threads held up every other constraint's compile.
GBNF_THREADS = 2
# The grammar engine compiles by recursion as deep as a constraint's rules chain or its schema's
# definitions nest, and overflowing a stack kills the process. Within MAX_STRUCTURED_CHARS the
# deepest measured (a Lark chain of 5,572 alternations) needed 16 to 20 MiB; threads get 8.
COMPILE_STACK_BYTES = 64 << 20
# The grammar engine reads GBNF in Python, in time quadratic in a chain of rules (64 KiB of them:
# 7 s of CPU). In this process it held the GIL the steps need between kernels. It runs in a process
# of its own (40 ms more a constraint), at the lowest priority past its first half second of CPU.
# `bench.compile_stall`: 8 streams decoding beside such a read kept 0.14 of their speed in this
# process, 0.23 in a child at full priority and 0.66 to 0.68 so; a small grammar read beside them
# takes 0.07 s (at the lowest priority throughout, 4 s).
GBNF_CPU_AT_FULL_PRIORITY_S = 0.5
# A grammar is Lark where a line opens with `%llguidance` or `start:`, as the grammar engine tells
# (gbnf_to_lark.is_lark_syntax). Its regex opens a line with `^\s*`, which backtracks over every
# run of blank lines below it: 18 s holding the GIL for 64 KiB of newlines. The same test with a
# line's leading space kept within the line (a match past blank lines starts at the last of them).
LARK_SYNTAX = re.compile(r"(?m)^[^\S\n]*(%llguidance\b|start\s*:)")
GBNF_TO_LARK = f"""
import os, signal, sys
signal.signal(signal.SIGVTALRM, lambda *_: os.nice(19))
signal.setitimer(signal.ITIMER_VIRTUAL, {GBNF_CPU_AT_FULL_PRIORITY_S})
from llguidance.gbnf_to_lark import gbnf_to_lark
try:
    sys.stdout.write(gbnf_to_lark(sys.stdin.read()))
except Exception as e:  # its refusals are bare Exceptions: the message, to stderr, exit 1
    sys.exit(str(e))
"""
# The name the grammar a constraint holds after a reasoning block goes by (_after_reasoning), and
# the block of each reasoning format: one the reply may open, or the rest of one the prompt opened.
AFTER_REASONING = "after_reasoning"
REASONING_BLOCKS = {"think": f'("{THINK_OPEN}" reasoning SPACE)?', "think_opened": "reasoning SPACE"}
COMPILE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass(frozen=True)
class GrammarStats:
    requests: int  # constrained requests submitted
    compiles: int  # constraints compiled (each one once while it stays cached)
    hits: int  # requests whose constraint was compiled already, or compiling
    compile_seconds: Histogram


class Grammars:
    def __init__(
        self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...], timeout_s: float
    ):
        """tokenizer_json: the model's tokenizer (a model folder without one takes no constraints:
        Request.check refuses them); vocab_size: the logits' width (the model's); timeout_s: the
        longest a request waits for its constraint to compile."""
        self._source = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._timeout_s = timeout_s
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()  # its first build, on a compile thread
        self._compiled: OrderedDict[Structured, Future] = OrderedDict()  # of the matcher to copy
        self._lock = threading.Lock()  # the cache and the counters
        self._pool = DeepStackThreads(COMPILE_THREADS, COMPILE_STACK_BYTES, "grammar")
        self._gbnf_pool = DeepStackThreads(GBNF_THREADS, COMPILE_STACK_BYTES, "gbnf")
        self.requests = self.compiles = self.hits = 0
        self.compile_seconds = Histogram(COMPILE_SECONDS_BUCKETS)

    def matcher(self, structured: Structured) -> llguidance.LLMatcher:
        """A new matcher at the start of `structured`'s output; InvalidArgument naming what is wrong
        with a constraint the grammar engine refuses, or when it compiles for longer than the
        timeout. Blocks its caller while the constraint compiles."""
        try:
            return self._compiling(structured).result(timeout=self._timeout_s).deep_copy()
        except CompileTimeout:
            raise self._too_slow(structured) from None

    async def matcher_async(self, structured: Structured) -> llguidance.LLMatcher:
        """matcher() for the event loop: it waits for the compile without holding a thread."""
        compiled = asyncio.shield(asyncio.wrap_future(self._compiling(structured)))  # shared: never cancelled
        try:
            return (await asyncio.wait_for(compiled, self._timeout_s)).deep_copy()
        except TimeoutError:
            raise self._too_slow(structured) from None

    def _compiling(self, structured: Structured) -> Future:
        """The constraint's compile, started now or found in the cache."""
        with self._lock:
            self.requests += 1
            compiled = self._compiled.get(structured)
            if compiled is None:
                gbnf = structured.kind == "grammar" and not is_lark(structured.spec)
                compiled = (self._gbnf_pool if gbnf else self._pool).submit(self._compile, structured)
                self._compiled[structured] = compiled
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self.hits += 1
                self._compiled.move_to_end(structured)
        return compiled

    def _too_slow(self, structured: Structured) -> InvalidArgument:
        return InvalidArgument(
            f"structured output {structured.kind} took longer than {self._timeout_s:g} s to "
            "compile (--grammar-compile-timeout); it goes on compiling, and a request with the "
            "same constraint will find it compiled"
        )

    def prepare(self) -> None:
        """Builds the grammar engine's view of the tokenizer now: its token trie, about 0.3 s on a
        49k vocabulary during which it holds the GIL, so every thread of the process waits. A
        serving engine builds it before it serves (Engine.start), not at its first constraint."""
        if self._source[0].is_file():
            _ = self._tokenizer

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(self.requests, self.compiles, self.hits, self.compile_seconds.copy())

    def close(self) -> None:
        self._pool.shutdown()
        self._gbnf_pool.shutdown()

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        """Built by prepare(), or else at the first constraint (an engine that only runs
        generate() need not pay for it)."""
        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                path, vocab_size, eos = self._source
                self._llg_tokenizer = llguidance.LLTokenizer(
                    path.read_text(), n_vocab=vocab_size, eos_token=eos
                )
            return self._llg_tokenizer

    def _compile(self, structured: Structured) -> llguidance.LLMatcher:
        """The matcher every request with this constraint copies (on a compile thread)."""
        start = time.perf_counter()
        try:
            return self._matcher_of(structured)
        finally:
            with self._lock:
                self.compiles += 1
                self.compile_seconds.observe(time.perf_counter() - start)

    def _matcher_of(self, structured: Structured) -> llguidance.LLMatcher:
        refused = f"structured output {structured.kind}: "
        try:
            grammar = _grammar(structured, self._timeout_s)
        except Exception as e:  # the grammar engine's refusals, or JSON nested past Python's recursion
            raise InvalidArgument(refused + str(e)) from None
        tokenizer = self._tokenizer
        # (is_error, messages): an error, or warnings such as a schema keyword the engine would
        # otherwise leave unenforced; either refuses the constraint (a strict schema holds whole)
        _, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if problems:
            raise InvalidArgument(refused + "; ".join(problems))
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        matcher.compute_bitmask()  # the first mask's lexer states, which every copy shares, built here
        if matcher.is_error():
            raise InvalidArgument(refused + matcher.get_error())
        return matcher


def _grammar(structured: Structured, timeout_s: float) -> str:
    grammar = _constraint_grammar(structured, timeout_s)
    return _after_reasoning(grammar, structured.after_reasoning) if structured.after_reasoning else grammar


def _after_reasoning(grammar: str, reasoning: str) -> str:
    """The grammar engine's grammar (a JSON list of grammars, the first the start) held after a
    reasoning block: one the reply may open ("think") or the prompt opened ("think_opened"), its
    text free until the first </think>. A blank line may follow the block (a JSON schema's compact
    text takes no space of its own)."""
    top = json.loads(grammar)
    first, *rest = top["grammars"]
    lark = "\n".join(
        [
            f"start: {REASONING_BLOCKS[reasoning]} @{AFTER_REASONING}",
            f'reasoning[lazy]: TEXT "{THINK_CLOSE}"',
            r"TEXT: /(.|\n)*/",
            r"SPACE: /[ \t\r\n]{0,4}/",  # a blank line, as templates write it; no run to stall in
        ]
    )
    held = {**first, "name": AFTER_REASONING}
    return json.dumps({**top, "grammars": [{"lark_grammar": lark + "\n"}, held, *rest]})


def _constraint_grammar(structured: Structured, timeout_s: float) -> str:
    """The grammar engine's list of grammars that holds the constraint, its start first."""
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
    lark = llguidance.LLMatcher.grammar_from_lark(spec if is_lark(spec) else _lark_of_gbnf(spec, timeout_s))
    return json.dumps({"grammars": [{"lark_grammar": lark}]})  # the list the others are


def is_lark(grammar: str) -> bool:
    """Whether a grammar constraint is Lark (else GBNF)."""
    return LARK_SYNTAX.search(grammar) is not None


def _lark_of_gbnf(gbnf: str, timeout_s: float) -> str:
    """GBNF (rules written with ::=) as Lark, read by the grammar engine in a child process."""
    try:
        return run_script(GBNF_TO_LARK, gbnf, timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"its GBNF took longer than {timeout_s:g} s to read (--grammar-compile-timeout)"
        ) from None
    except ScriptFailed as e:
        raise ValueError(str(e)) from None


def mask_rows(logits: torch.Tensor, matchers: list, kernel: CpuTokenMask | None = None) -> torch.Tensor:
    """logits [rows, vocab], the step's own, with every token row i's matcher forbids set to -inf
    in place (matchers[i] None: row i is left as it is), and returned. The matchers write their
    bitmasks (bit k of word w: token 32 w + k may come) straight into a tensor, which `kernel`
    (the CPU's, where built) applies in place, or torch ops; llguidance's own torch helpers are
    not used, as they torch.compile at import and at their first call."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    words = -(-logits.shape[1] // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [c, words]
    for j, i in enumerate(rows):
        matchers[i].unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
    if kernel is not None:  # the runner passes one only on the CPU
        kernel(logits, bitmask, torch.tensor(rows))
        return logits
    return masked_by_torch(logits, bitmask, rows)


def masked_by_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """mask_rows' fill by torch ops, on any device: bitmask [c, words] unpacked on the logits'
    device (a 32nd of the bytes of the bool mask to move) into [c, vocab] bools."""
    vocab = logits.shape[1]
    bitmask = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [c, vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
