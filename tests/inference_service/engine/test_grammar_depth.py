"""Constraints that chain or nest as deep as their bound allows compile, in the engine's own
grammar cache, without overflowing a stack: each is compiled in a child process (an overflow kills
the process that compiles), one after another, reporting as it goes."""

import json
import subprocess
import sys

import pytest

from tests.deep_constraints import DEEP

CHILD = """
import json, sys
from pathlib import Path
from inference_service.engine.grammars import Grammars
from inference_service.sampling import Structured
from tests.deep_constraints import DEEP, deepest
tokenizer, vocab_size = Path(sys.argv[1]), int(sys.argv[2])
grammars = Grammars(tokenizer, vocab_size, (0,), timeout_s=60)
for name, (kind, build) in DEEP.items():
    grammars.matcher(Structured(kind, deepest(build)))
    print(json.dumps(name), flush=True)
del grammars  # the cached matchers dropped here, on the main thread, as an eviction drops them
print(json.dumps("dropped"), flush=True)
"""


@pytest.fixture(scope="module")
def compiled(tiny_chat_model) -> tuple[list[str], subprocess.CompletedProcess]:
    """What the child compiled, in order, and how it ended."""
    vocab_size = json.loads((tiny_chat_model / "config.json").read_text())["vocab_size"]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_chat_model / "tokenizer.json"), str(vocab_size)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return [json.loads(line) for line in child.stdout.splitlines()], child


@pytest.mark.parametrize("name", [*DEEP, "dropped"])
def test_the_deepest_constraint_within_the_bound_compiles(compiled, name):
    done, child = compiled
    assert name in done, f"the child stopped with {child.returncode} before it: {child.stderr[-2000:]}"
    assert child.returncode == 0, child.stderr[-2000:]
