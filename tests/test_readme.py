"""The README's usage example runs, and its test command is what CI runs."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as handle:
        return handle.read()


def test_usage_example_runs():
    usage = _readme().split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", _readme(), re.S)
    test_command = commands[1].split("&&")[-1].strip()
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        ci_lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    assert ci_lines[-1] == test_command


def test_settings_table_lists_every_config_field():
    import dataclasses

    import actoff

    readme = _readme()
    for field in dataclasses.fields(actoff.Config):
        assert f"`ACTOFF_{field.name.upper()}`" in readme, field.name


@pytest.mark.parametrize(("title", "at_least"), [("Guarantees", 20), ("Works with", 15)])
def test_tables_name_existing_tests(title, at_least):
    section = _readme().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for row in re.findall(r"^\|.*\|$", section, re.M):
        current = None
        for reference in re.findall(r"`(test_[^`]*|::[^`]*)`", row):
            path, _, name = (
                reference.partition("::") if not reference.startswith("::") else ("", "", reference[2:])
            )
            current = path or current
            with open(os.path.join(ROOT, "tests", current)) as handle:
                source = handle.read()
            if name:
                assert f"def {name}(" in source, f"{current}::{name} named in the README does not exist"
                checked += 1
    assert checked >= at_least
