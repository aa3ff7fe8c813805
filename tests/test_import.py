"""Importing actoff is cheap and safe: no CUDA initialisation; the extension is optional."""

import subprocess
import sys

import actoff


def test_import_does_not_initialise_cuda():
    code = "import torch, actoff, actoff.reference; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_does_not_load_dynamo():
    """Dynamo's import is about a second, as long as torch's own: every worker the benchmarks
    start and every script paid it twice. It loads where a compile asks for it, not before."""
    code = "import sys, torch, actoff, actoff.reference; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_extension_flag_matches_the_module():
    try:
        from actoff import _C  # noqa: F401

        built = True
    except ImportError:
        built = False
    assert actoff.HAS_EXTENSION is built


def test_public_api():
    for name in actoff.__all__:
        assert hasattr(actoff, name), name
        obj = getattr(actoff, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
