"""Constraints whose rules chain, or whose schema's definitions nest, as deep as a constraint's
bound on its text allows: the grammar engine compiles them by recursion that deep, and on a thread
of the default 8 MiB stack each of these overflows it and kills the process."""

import itertools
import json
import string
from collections.abc import Callable

from inference_service.sampling import MAX_STRUCTURED_CHARS


def _names(count: int) -> list[str]:
    return [
        "".join(letters)
        for letters in itertools.islice(itertools.product(string.ascii_lowercase, repeat=3), count)
    ]


def lark_alternations(depth: int) -> str:
    """aaa: aab | "a", down to the last rule: the deepest per character of those measured."""
    n = _names(depth + 1)
    rules = [f'{n[i]}:{n[i + 1]}|"a"' for i in range(depth)]
    return "\n".join([f"start:{n[0]}", *rules, f'{n[depth]}:"b"'])


def lark_terminals(depth: int) -> str:
    """Terminals each made of the next: AAA: "a" AAB."""
    n = [name.upper() for name in _names(depth + 1)]
    rules = [f'{n[i]}:"a"{n[i + 1]}' for i in range(depth)]
    return "\n".join([f"start:{n[0]}", *rules, f'{n[depth]}:"b"'])


def _schema_chain(depth: int, link: Callable[[dict], dict]) -> str:
    n = _names(depth + 1)
    defs = {n[i]: link({"$ref": f"#/$defs/{n[i + 1]}"}) for i in range(depth)}
    defs[n[depth]] = {"type": "string"}
    return json.dumps({"$ref": f"#/$defs/{n[0]}", "$defs": defs}, separators=(",", ":"))


def schema_items(depth: int) -> str:
    """Arrays of arrays through $defs (not nested in the text, which JSON readers bound)."""
    return _schema_chain(depth, lambda inner: {"items": inner})


def schema_any_of(depth: int) -> str:
    return _schema_chain(depth, lambda inner: {"anyOf": [inner, {"type": "null"}]})


DEEP = {  # name: (Structured kind, builder of a given depth)
    "lark alternations": ("grammar", lark_alternations),
    "lark terminals": ("grammar", lark_terminals),
    "schema items": ("json_schema", schema_items),
    "schema anyOf": ("json_schema", schema_any_of),
}


def deepest(build: Callable[[int], str]) -> str:
    """build(depth) for the largest depth whose text is within MAX_STRUCTURED_CHARS."""
    low, high = 1, MAX_STRUCTURED_CHARS // 8  # every builder takes more than 8 characters a level
    while low < high:
        middle = (low + high + 1) // 2
        if len(build(middle)) <= MAX_STRUCTURED_CHARS:
            low = middle
        else:
            high = middle - 1
    return build(low)
