"""The package's shape: no import circle between actoff's modules, and modules of a readable size."""

import ast
import os
import pathlib

import actoff

PACKAGE = os.path.dirname(actoff.__file__)


def _imports(path: str) -> set[str]:
    """actoff modules imported anywhere in a file (top level, functions, TYPE_CHECKING blocks)."""
    tree = ast.parse(pathlib.Path(path).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("actoff."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("actoff."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py"}
    return {m: _imports(os.path.join(PACKAGE, m + ".py")) & modules for m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_inside_actoff():
    graph = _graph()
    assert graph.get("_runtime"), "the import graph was not derived"
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_records_depend_on_nothing_above_them():
    assert _graph()["_record"] == set()


def test_modules_and_classes_stay_readable():
    for name in os.listdir(PACKAGE):
        if not name.endswith(".py"):
            continue
        source = pathlib.Path(PACKAGE, name).read_text()
        if name != "planner.py":  # one concept, allowed to be longer
            assert source.count("\n") <= 420, f"{name} has {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= 260, f"{name}: class {node.name} has {length} lines"


def test_the_runtime_never_asks_which_tier_a_record_is_in():
    for name in os.listdir(PACKAGE):
        if name.endswith(".py"):
            source = pathlib.Path(PACKAGE, name).read_text()
            assert "tier ==" not in source, name
            if name not in ("tiers/base.py", "tiers/nvme/tier.py", "device/base.py"):
                assert "backend.staged" not in source, name
