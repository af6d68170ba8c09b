"""GBNF constraints are read into Lark by the grammar engine's Python reader in a child process,
never in the worker's own (where its GIL would stall the steps), at the lowest priority once it
has used its share of CPU at full priority; its refusals and a read past the compile timeout
are INVALID_ARGUMENT naming the cause."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import llguidance.gbnf_to_lark
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from inference_service.engine import grammars
from inference_service.engine.grammars import GBNF_CPU_AT_FULL_PRIORITY_S, GBNF_TO_LARK, Grammars
from inference_service.sampling import MAX_STRUCTURED_CHARS, Structured
from shared.errors import InvalidArgument

YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no"'


def chain(rules: int) -> str:
    """root ::= r0, r0 ::= "a" r1, ...: read in time quadratic in its length."""
    return "\n".join(["root::=r0", *(f'r{i}::="a"r{i + 1}' for i in range(rules)), f'r{rules}::="b"'])


@pytest.fixture
def compiler(tiny_chat_model):
    vocab = json.loads((tiny_chat_model / "config.json").read_text())["vocab_size"]
    return lambda timeout_s=60: Grammars(tiny_chat_model / "tokenizer.json", vocab, (0,), timeout_s)


@pytest.fixture
def follows(tiny_chat_model):
    """Whether a matcher takes `text` whole and may end after it."""
    tokenizer = Tokenizer.from_file(str(tiny_chat_model / "tokenizer.json"))

    def check(matcher, text: str) -> bool:
        return (
            matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False).ids)
            and matcher.is_accepting()
        )

    return check


def test_gbnf_is_read_outside_this_process(compiler, follows, monkeypatch):
    def not_here(text):
        raise AssertionError("GBNF read in the worker's process")

    monkeypatch.setattr(llguidance.gbnf_to_lark, "gbnf_to_lark", not_here)
    monkeypatch.setattr(llguidance.gbnf_to_lark, "any_to_lark", not_here)
    matcher = compiler().matcher(Structured("grammar", YES_NO))
    assert follows(matcher, "yes.")


def test_lark_is_not_sent_to_a_child(compiler, follows, monkeypatch):
    monkeypatch.setattr(grammars, "run_script", None)  # calling it would fail
    matcher = compiler().matcher(Structured("grammar", 'start: "yes" | "no"'))
    assert follows(matcher, "no")


def test_a_refusal_names_the_cause(compiler):
    with pytest.raises(InvalidArgument, match=r"structured output grammar: .*undefined_rule"):
        compiler().matcher(Structured("grammar", "root ::= undefined_rule"))


def test_a_read_past_the_timeout_is_refused_naming_it(compiler):
    text = chain(2000)  # seconds to read, and within the bound
    assert len(text) <= MAX_STRUCTURED_CHARS
    slow = compiler(timeout_s=0.3)
    with pytest.raises(InvalidArgument, match="--grammar-compile-timeout"):
        slow.matcher(Structured("grammar", text))
    deadline = time.monotonic() + 30
    while slow.stats().compiles == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the compile goes on, and ends with the child's timeout
    with pytest.raises(InvalidArgument, match=r"its GBNF took longer than 0\.3 s to read"):
        slow.matcher(Structured("grammar", text))


def _cpu_and_nice(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[16])


def test_a_long_read_drops_to_the_lowest_priority_after_its_share():
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", GBNF_TO_LARK],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        child.stdin.write(chain(4000))
        child.stdin.close()
        seen = []
        while child.poll() is None:
            seen.append(_cpu_and_nice(child.pid))
            if seen[-1][0] > GBNF_CPU_AT_FULL_PRIORITY_S + 0.2:
                break
            time.sleep(0.01)
        assert seen[0][1] == 0  # at full priority while it starts
        assert seen[-1] == (seen[-1][0], 19), seen[-1]
    finally:
        child.kill()
        child.wait()


def test_slow_reads_hold_up_no_other_constraint(compiler, follows):
    """Two GBNF reads that each run to the timeout: a Lark grammar and a schema asked for after
    them compile while both still wait on their children (before the fix they waited behind them
    on the two compile threads, and ran out of time)."""
    grammars = compiler(timeout_s=3)
    grammars.prepare()  # the tokenizer's first build, which every compile waits on, done here
    texts = [chain(rules) for rules in (3800, 3801)]  # each seconds to read, within the bound
    refusals = []

    def read(text: str) -> None:
        try:
            grammars.matcher(Structured("grammar", text))
        except InvalidArgument as e:
            refusals.append(str(e))

    readers = [threading.Thread(target=read, args=(text,)) for text in texts]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 30
    while grammars.stats().requests < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert follows(grammars.matcher(Structured("grammar", 'start: "yes" | "no"')), "no")
    assert follows(grammars.matcher(Structured("json_schema", '{"type": "boolean"}')), "true")
    assert all(reader.is_alive() for reader in readers)
    for reader in readers:
        reader.join()
    assert len(refusals) == 2 and all("--grammar-compile-timeout" in r for r in refusals), refusals
    grammars.close()


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["\n", " ", "\t", "\r", "\x0b", "\u2028", "start", ":", "%llguidance", "a", "_", "::="]
        )
    )
)
def test_lark_is_told_from_gbnf_as_the_grammar_engine_tells_it(pieces):
    text = "".join(pieces)
    assert grammars.is_lark(text) == llguidance.gbnf_to_lark.is_lark_syntax(text)


def test_a_grammar_of_blank_lines_is_read_not_timed_out(compiler):
    """64 KiB of newlines: the grammar engine's own Lark test backtracks over them for seconds
    (18 s on the machine this was written on), holding the GIL; ours is linear, and the text goes
    to the GBNF reader, which refuses it by name within the timeout."""
    with pytest.raises(InvalidArgument, match="No 'root' rule found"):
        compiler(timeout_s=2).matcher(Structured("grammar", "\n" * MAX_STRUCTURED_CHARS))
