"""The worker's modules stay small enough to read in one sitting: at most 250 lines of code each
(docstrings, comments and blank lines aside). A module past it holds more than one noun; split
it (as engine.py gave up its inbox and its snapshot)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "inference_service"
MAX_CODE_LINES = 250


def _code_lines(path: Path) -> int:
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source, str(path))):
        scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, scopes) and ast.get_docstring(node) is not None:
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#") and number not in docstrings
    )


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_worker_module_holds_at_most_250_lines_of_code(path):
    assert _code_lines(path) <= MAX_CODE_LINES
