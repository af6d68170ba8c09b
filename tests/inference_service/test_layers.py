"""The worker's rooms, as the README's Layout section draws them: each imports only rooms above
it, nothing imports demo/, only demo/ uses the client SDK, and no module imports itself back
through others. Read from the source with `ast`, so a forbidden import fails here before it can
grow roots."""

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "inference_service"
# Top to bottom; a room may import the rooms above it (and shared/, kernels/, third parties).
ROOMS = ("model", "sampling", "default_model", "torch_threads", "adapters", "engine", "server", "demo")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    """The package a relative import in this file is resolved against."""
    module = _module(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(path: Path) -> set[str]:
    """Every module this file names in an import statement, at any depth (a function-local import
    is an edge all the same); relative imports are resolved against the file's package, so
    `from ..engine import scheduler` counts as `inference_service.engine.scheduler`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), _package(path))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def _edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(a, b) for a, targets in graph.items() for b in sorted(targets)]


def test_every_module_lives_in_a_room():
    homeless = [
        m
        for m in _graph()
        if _room(m) is None and m not in {"inference_service", "inference_service.__main__"}
    ]
    assert homeless == []


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_rooms_above_it(room):
    above = set(ROOMS[: ROOMS.index(room) + 1])
    wrong = [(a, b) for a, b in _edges(_graph()) if _room(a) == room and _room(b) not in above]
    assert wrong == []


def test_only_demo_uses_the_client_sdk():
    users = sorted(
        _module(p)
        for p in PACKAGE.rglob("*.py")
        if any(m == "client" or m.startswith("client.") for m in _imports(p)) and _room(_module(p)) != "demo"
    )
    assert users == []


def test_no_import_cycles():
    graph = _graph()
    done: set[str] = set()

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            found = cycle_from(target, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    cycles = [c for c in (cycle_from(m, []) for m in sorted(graph)) if c]
    assert cycles == []
