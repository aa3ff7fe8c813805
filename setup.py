"""Build script: the optional compiled core ``actoff._C`` (pybind11, C++17) and, where nvcc is
found, the replay allocator ``actoff/libactoff_replay.so`` (CUDA runtime API, no kernels).

``ACTOFF_BUILD_EXT=0`` gives a pure-Python install (actoff then uses its Python I/O engine
and has no replay allocator). ``actoff._C`` includes no torch headers, so a CPU-only torch
builds it in seconds. The replay allocator is a plain shared library, not a Python
extension: torch's ``CUDAPluggableAllocator`` loads it by path. It is built with nvcc from
``CUDA_HOME`` (or ``CUDA_PATH``), else from ``PATH``, linked with the static CUDA runtime so
that loading it needs no libcudart; without nvcc the build says so and goes on. Build it
against the installed torch with ``pip install --no-build-isolation -e .``.
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_ext import build_ext

REPLAY_LIBRARY = "libactoff_replay.so"
REPLAY_SOURCES = ["csrc/replay_cuda.cu", "csrc/replay_allocator.cpp", "csrc/replay_allocator.h"]
REPLAY_EXPORTS = "csrc/replay_cuda.map"


def find_nvcc():
    """nvcc of CUDA_HOME or CUDA_PATH when set, else the one on PATH; None without one."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            candidate = os.path.join(home, "bin", "nvcc")
            if os.access(candidate, os.X_OK):
                return candidate
    return shutil.which("nvcc")


class BuildExt(build_ext):
    """``build_ext`` that also builds the replay allocator library (see the module docstring)."""

    def _replay_paths(self):
        package_dir = self.get_finalized_command("build_py").get_package_dir("actoff")
        built = os.path.join(self.build_lib, "actoff", REPLAY_LIBRARY)
        return built, os.path.join(package_dir, REPLAY_LIBRARY)

    def run(self):
        super().run()
        built, inplace = self._replay_paths()
        if self._build_replay(built) and self.inplace:
            self.copy_file(built, inplace, level=self.verbose)

    def _build_replay(self, output):
        nvcc = find_nvcc()
        if nvcc is None:
            print(f"actoff: nvcc not found (CUDA_HOME, CUDA_PATH, PATH): {REPLAY_LIBRARY} is not built; "
                  "ACTOFF_ALLOCATOR=replay will be refused")  # fmt: skip
            return False
        inputs = [*REPLAY_SOURCES, REPLAY_EXPORTS]
        newest = max(os.path.getmtime(path) for path in inputs)
        if os.path.exists(output) and not self.force and os.path.getmtime(output) >= newest:
            return True
        os.makedirs(os.path.dirname(output), exist_ok=True)
        command = [
            nvcc, "-O2", "-std=c++17", "-shared", "-cudart", "static",
            "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall",
            "-Xlinker", f"--version-script={REPLAY_EXPORTS}",
            "-Icsrc", "csrc/replay_cuda.cu", "csrc/replay_allocator.cpp", "-o", output,
        ]  # fmt: skip
        print(" ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            # The library is optional: report and go on, as without nvcc.
            print(f"actoff: building {REPLAY_LIBRARY} failed; ACTOFF_ALLOCATOR=replay will be refused\n"
                  f"{result.stdout}{result.stderr}")  # fmt: skip
            return False
        return True

    def get_outputs(self):
        built, inplace = self._replay_paths()
        extra = [inplace if self.inplace else built] if os.path.exists(built) else []
        return [*super().get_outputs(), *extra]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        built, inplace = self._replay_paths()
        if self.inplace and os.path.exists(built):
            mapping[inplace] = built
        return mapping


ext_modules = []
if os.environ.get("ACTOFF_BUILD_EXT", "1").strip().lower() not in ("0", "false", "no", "off"):
    from pybind11.setup_helpers import Pybind11Extension

    ext_modules.append(
        Pybind11Extension(
            "actoff._C",
            sources=[
                "csrc/python_bindings.cpp",
                "csrc/io_engine.cpp",
                "csrc/crc32c.cpp",
                "csrc/replay_allocator.cpp",
            ],
            include_dirs=["csrc"],
            cxx_std=17,
            extra_compile_args=["-O2", "-Wall"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
