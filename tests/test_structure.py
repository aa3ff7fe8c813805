"""The package's shape: imports point down the data flow, no import circle, readable sizes.

The layers, from the user's call down to the device (a module may import only from its own
layer or the layers below it, ``TYPE_CHECKING`` imports for types included):

    public surface  actoff (__init__), testing, reference, introspect, reporting, integrations/
    scope           where offload scopes begin: offload, offload_, no_offload, compile
    tiling          tile_ and the chunked loss (beside scope: neither imports the other)
    runtime         one step: hooks, scope runs, placements, the runtime, auto, stats, ranks
    tiers           where a record's bytes live: record, cpu, nvme/, tokenwise/
    rerun           what every placement that runs a block again needs
    memory          arenas and their layouts, the replay allocator
    device          device backends: base, cuda, sim/
    leaves          config, policy, budget, step_time, fitting, planner, params, owners, figures, units, module_classes, _version:
                    pure, import only each other
"""

import ast
import pathlib
import re

import pytest

import actoff

pytestmark = pytest.mark.plain_pass_only  # no device involved: one pass is enough

PACKAGE = pathlib.Path(actoff.__file__).parent
ROOT = PACKAGE.parent

LAYERS = {  # rank: lower imports nothing above it
    "public": 0,
    "integrations": 0,  # adapters to other libraries (Hugging Face's Trainer): public surface
    "scope": 1,
    "tiling": 1,
    "runtime": 2,
    "tiers": 3,
    "rerun": 4,
    "memory": 5,
    "device": 6,
    "leaves": 7,
}
TOP_LEVEL = {
    **dict.fromkeys(("__init__", "testing", "reference", "introspect", "reporting"), "public"),
    **dict.fromkeys(
        (
            "config",
            "policy",
            "budget",
            "step_time",
            "fitting",
            "units",
            "planner",
            "params",
            "owners",
            "figures",
            "module_classes",
        ),
        "leaves",
    ),
    **dict.fromkeys(("_version", "_C"), "leaves"),
}
PEERS_APART = {("scope", "tiling"), ("tiling", "scope")}  # same rank, still independent


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package (packages by their __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found["actoff._C"] = ROOT / "csrc" / "python_bindings.cpp"  # the compiled extension: a leaf
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "public"
    if len(parts) == 2 and parts[1] in TOP_LEVEL:
        return TOP_LEVEL[parts[1]]
    return parts[1]


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom, modules) -> list[str]:
    """The modules an ``import from`` depends on: those it names (``from actoff import _C``),
    and the module it imports from when it takes anything else from it."""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    named = [f"{target}.{alias.name}" for alias in node.names]
    found = [name for name in named if name in modules]
    return found if len(found) == len(named) else [target, *found]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return ids


def _graph(*, with_type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the actoff modules it imports anywhere (top level or inside functions)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        if path.suffix != ".py":
            graph[module] = set()
            continue
        tree = ast.parse(path.read_text())
        skip = set() if with_type_checking else _type_checking_nodes(tree)
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                targets.update(t for t in _resolve(module, path, node, modules) if t in modules)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
        graph[module] = targets - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
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


def _upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        mine = _layer(module)
        for target in targets:
            theirs = _layer(target)
            if theirs == mine or target == "actoff":
                continue
            if LAYERS[theirs] < LAYERS[mine] or (mine, theirs) in PEERS_APART:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return sorted(bad)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_layer_rule_finds_an_import_up_the_flow():
    assert _upward({"actoff.device.base": {"actoff.runtime.step"}}) == [
        "actoff.device.base (device) imports actoff.runtime.step (runtime)"
    ]
    assert _upward({"actoff.scope.offload": {"actoff.tiling.tile"}})  # peers stay apart
    assert _upward({"actoff.runtime.step": {"actoff.tiers.record", "actoff.config"}}) == []


def test_every_module_has_a_layer():
    assert "actoff.runtime.hooks" in _modules(), "the module list was not derived"
    for module in _modules():
        assert _layer(module) in LAYERS, f"{module} has no layer: add it to LAYERS or TOP_LEVEL"


def test_imports_point_down_the_flow():
    # Types only included: a type-only import up the flow is an arrow back up all the same.
    assert _upward(_graph(with_type_checking=True)) == []


def test_no_import_circle_inside_actoff():
    graph = _graph()
    assert graph["actoff.runtime.runtime"], "the import graph was not derived"
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _folder(module: str) -> str:
    """A module's folder (``actoff.tiers.nvme.tier`` -> ``actoff.tiers.nvme``), a top-level one's layer."""
    parts = module.split(".")
    return ".".join(parts[:-1]) if len(parts) > 2 else f"actoff.<{_layer(module)}>"


def test_no_circle_between_folders_types_included():
    graph = _graph(with_type_checking=True)
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = _folder(module)
        folders.setdefault(mine, set()).update(
            _folder(t) for t in targets if _folder(t) != mine and not mine.startswith(_folder(t) + ".")
        )
    assert _cycle({"a": {"b"}, "b": {"a"}}), "the circle finder works on folders too"
    cycle = _cycle(folders)
    assert cycle is None, "folders in a circle: " + " -> ".join(cycle)


def test_nothing_below_the_runtime_reaches_for_it():
    """Tiers see their run through a narrow view (Note [tiers see a view of their run]): no
    ``.runtime`` attribute below the runtime's layer."""
    below = [m for m in _modules() if LAYERS[_layer(m)] > LAYERS["runtime"] and _modules()[m].suffix == ".py"]
    assert "actoff.tiers.nvme.tier" in below
    reaching = []
    for module in below:
        for node in ast.walk(ast.parse(_modules()[module].read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "runtime":
                reaching.append(f"{module}:{node.lineno}")
    assert reaching == []


def test_only_the_policy_table_knows_policies_by_name():
    """No policy name is compared outside actoff.policy (Note [the policy table])."""
    compare = re.compile(r"\.policy\s*(==|!=|in\b|not in\b)|\bpolicy\s*(==|!=)\s*[\"']")
    found = []
    for module, path in _modules().items():
        if path.suffix != ".py" or module == "actoff.policy":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if compare.search(code) and ">>>" not in line:
                found.append(f"{module}:{number}: {line.strip()}")
    assert found == []


def test_records_depend_on_nothing_above_them():
    assert _graph()["actoff.tiers.record"] == set()


def _sources() -> list[tuple[str, pathlib.Path]]:
    files = [(module, path) for module, path in _modules().items() if path.suffix == ".py"]
    files += [(str(path.relative_to(ROOT)), path) for path in (ROOT / "benchmarks").rglob("*.py")]
    return files


def test_modules_functions_and_classes_stay_readable():
    """No file over 450 lines, no function over 80, no class over 300 (docstrings included): a
    concept that needs more is two concepts."""
    too_long = []
    for name, path in _sources():
        source = path.read_text()
        if source.count("\n") > 450:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            limit = 300 if isinstance(node, ast.ClassDef) else 80
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{name}: {node.name} has {length} lines")
    assert too_long == []


def _skipped_formatting(source: str) -> list[int]:
    """Lines with ``# fmt: skip`` that are not the end of a table: an assignment of a literal
    tuple, list, dict or set, whose rows read better aligned."""
    tree = ast.parse(source)
    tables = {
        node.end_lineno
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, (ast.Tuple, ast.List, ast.Dict, ast.Set))
    }
    lines = source.splitlines()
    return [n for n, line in enumerate(lines, 1) if "# fmt: skip" in line and n not in tables]


def test_formatting_is_skipped_for_tables_only():
    skip = "  # fmt: " + "skip"  # (written so, or this file would hold the comment it looks for)
    assert _skipped_formatting(f"x = (\n  1, 2,\n){skip}\n") == []
    assert _skipped_formatting(f"f(1,\n  2){skip}\n") == [2]
    found = [f"{name}:{n}" for name, path in _sources() for n in _skipped_formatting(path.read_text())]
    assert found == []


def test_every_package_says_what_it_owns():
    for path in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and "TODO" not in doc and len(doc.splitlines()) >= 3, f"{path} needs a docstring map"


def test_the_runtime_never_asks_which_tier_a_record_is_in():
    allowed = {"tiers/cpu.py", "tiers/nvme/tier.py", "device/base.py"}
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        name = path.relative_to(PACKAGE).as_posix()
        assert "tier ==" not in source, name
        if name not in allowed:
            assert "backend.staged" not in source, name


def _notes() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Note definitions (a line starting with the note's name) and citations, across the project."""
    defined: dict[str, list[str]] = {}
    cited = []
    files = [
        *PACKAGE.rglob("*.py"),
        *ROOT.glob("csrc/*.*"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("benchmarks/**/*.py"),
    ]
    for path in files:
        if path.suffix in (".so",):
            continue
        for line in path.read_text(errors="replace").splitlines():
            for name in re.findall(r"Note \[([^\]]+)\]", line):
                cited.append((name, str(path.relative_to(ROOT))))
            match = re.match(r"\s*(?:#|//|\"\"\"|)\s*Note \[([^\]]+)\](?::|$)", line)
            if match:
                defined.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    return defined, cited


def test_every_note_is_defined_once_and_every_citation_resolves():
    defined, cited = _notes()
    assert defined, "no Note was found"
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert twice == {}, f"notes defined more than once: {twice}"
    dangling = sorted({(name, where) for name, where in cited if name not in defined})
    assert dangling == [], f"notes cited but defined nowhere: {dangling}"


@pytest.mark.parametrize("text", ["borrowed", "10-minute", "device time", "lent"])
def test_nothing_speaks_of_borrowed_machines(text):
    files = [*PACKAGE.rglob("*.py"), ROOT / "README.md"]
    for path in files:  # whole words: "silently" is no lent machine
        found = re.search(rf"\b{re.escape(text)}\b", path.read_text().lower())
        assert found is None, f"{path.relative_to(ROOT)} speaks of {text!r}"


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, (
        f"README.md has {lines} lines: details belong in tests/README.md or benchmarks/README.md"
    )
