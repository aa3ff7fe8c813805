"""Every example in actoff's docstrings runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import actoff

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(actoff.__path__, "actoff.")
    # compiled; kernels only (tested in test_pack); a plain C library (its .so suffix fools pkgutil)
    if name not in ("actoff._C", "actoff.tiers.tokenwise.rows_triton", "actoff.libactoff_replay")
)


# The examples show what a user's own process prints: they build their simulated devices
# themselves, so under ACTOFF_SIM_DEVICE=1 they run outside the suite's per-test device.
@pytest.mark.no_sim_device
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if name == "actoff.integrations.huggingface":  # the adapter imports the library it adapts to
        pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
