"""The documents hold true: the README's example runs and CI runs its test command; its settings
table names every setting; tests/README.md's tables name tests that exist; links and cited
result files exist."""

import os
import re

import pytest

pytestmark = pytest.mark.plain_pass_only  # no device involved: one pass is enough

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
DOCUMENTS = ("README.md", "tests/README.md", "benchmarks/README.md", "csrc/README.md")


def _read(name: str = "README.md") -> str:
    with open(os.path.join(ROOT, name)) as handle:
        return handle.read()


def test_usage_example_runs():
    usage = _read().split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", _read(), re.S)
    test_command = commands[1].split("&&")[-1].strip()
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        ci_lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    assert ci_lines[-1] == test_command


def test_settings_table_lists_every_config_field():
    import dataclasses

    import actoff

    readme = _read()
    for field in dataclasses.fields(actoff.Config):
        assert f"`ACTOFF_{field.name.upper()}`" in readme, field.name


@pytest.mark.parametrize(("title", "at_least"), [("Guarantees", 20), ("Works with", 15)])
def test_tables_name_existing_tests(title, at_least):
    """Each `path::name` in a table row exists; `::name` takes the row's last path. Paths are
    relative to tests/ and may sit in folders (`memory/test_device_arena.py::test_...`)."""
    section = _read("tests/README.md").split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for row in re.findall(r"^\|.*\|$", section, re.M):
        current = None
        for reference in re.findall(r"`((?:[\w.]+/)*test_[^`]*|::[^`]*)`", row):
            path, _, name = reference.partition("::")
            current = path or current
            assert current is not None, f"{reference!r} in {title} follows no test file"
            with open(os.path.join(TESTS, current)) as handle:
                source = handle.read()
            if name:
                assert f"def {name}(" in source, f"{current}::{name} named in tests/README.md does not exist"
                checked += 1
    assert checked >= at_least


@pytest.mark.parametrize("document", DOCUMENTS)
def test_links_and_cited_results_exist(document):
    """Relative links resolve, and every file under benchmarks/results/ a document cites is
    committed (a figure is only as good as the file it comes from)."""
    text = _read(document)
    folder = os.path.dirname(os.path.join(ROOT, document))
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(folder, target)), f"{document} links to missing {target}"
    for cited in re.findall(r"benchmarks/results/[\w./-]*[\w/]", text):
        assert os.path.exists(os.path.join(ROOT, cited)), f"{document} cites missing {cited}"


def _claims(text: str):
    """Paragraphs, and each table row apart: a table's header row goes with the paragraph that
    introduces the table."""
    before = ""
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.strip().splitlines()
        if lines and lines[0].startswith("|"):
            yield lines[0] + "\n" + before  # the header, with what introduces it
            yield from lines[2:]
        else:
            yield paragraph
        before = paragraph


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_gpu_claim_cites_a_committed_result(document):
    """What a GPU did is said only with the file under benchmarks/results/ that shows it: every
    paragraph or table row that names the GPU a run measured on cites a results file."""
    for claim in _claims(_read(document)):
        if re.search(r"\bH[12]00\b", claim):
            assert re.search(r"results/[\w.-]+", claim), (
                f"{document}: no results file cited for: {claim[:300]}"
            )
