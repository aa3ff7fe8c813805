"""Build script: the optional compiled core ``actoff._C`` (pybind11, C++17).

``ACTOFF_BUILD_EXT=0`` gives a pure-Python install (actoff then uses its Python I/O
engine). The extension includes no torch headers, so a CPU-only torch builds it in seconds;
CUDA sources (the planned allocator) are to be compiled only where torch has CUDA.
Build it against the installed torch with ``pip install --no-build-isolation -e .``.
"""

import os

from setuptools import setup

ext_modules = []
if os.environ.get("ACTOFF_BUILD_EXT", "1").strip().lower() not in ("0", "false", "no", "off"):
    from pybind11.setup_helpers import Pybind11Extension

    ext_modules.append(
        Pybind11Extension(
            "actoff._C",
            sources=["csrc/module.cpp", "csrc/io_engine.cpp", "csrc/replay_allocator.cpp"],
            include_dirs=["csrc"],
            cxx_std=17,
            extra_compile_args=["-O2", "-Wall"],
        )
    )

setup(ext_modules=ext_modules)
