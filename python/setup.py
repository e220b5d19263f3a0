"""Installs the muond Python package; the gRPC stubs are generated from proto/ while building.

    pip install ./python          (from the repository root)

The streaming host copy (muond/_stream_copy.c, plain C loaded with ctypes) is compiled when a C
compiler is present; without one the package installs without it and copies with torch's copy_.

Stub generation needs grpcio-tools, or protoc plus grpc_python_plugin on PATH (Debian:
protobuf-compiler and protobuf-compiler-grpc); see muond/_codegen.py.
"""

import importlib.util
import os
import re
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
os.chdir(HERE)  # package discovery is relative to the working directory


def _proto_root() -> Path:
    # proto/ sits beside python/ in the repository; an sdist carries its own copy.
    for candidate in (HERE / "proto", HERE.parent / "proto"):
        if (candidate / "muond" / "v1" / "muond.proto").is_file():
            return candidate
    raise SystemExit("muond: proto/muond/v1/muond.proto not found next to the python/ folder")


def _codegen():
    spec = importlib.util.spec_from_file_location("muond_codegen", HERE / "muond" / "_codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py that also writes muond/_proto/ (into the source tree for editable installs)."""

    def run(self):
        super().run()
        target = HERE if getattr(self, "editable_mode", False) else Path(self.build_lib)
        codegen = _codegen()
        try:
            codegen.generate(_proto_root(), target)
        except codegen.CodegenError as err:
            raise SystemExit(f"muond: {err}") from None


class SdistWithProto(sdist):
    """sdist that carries proto/ so the stubs can be generated from the archive alone."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dest = Path(base_dir) / "proto" / "muond" / "v1"
        dest.mkdir(parents=True, exist_ok=True)
        source = _proto_root() / "muond" / "v1"
        for path in sorted(source.glob("*.proto")) + [source / "group_options.json"]:  # the API, its option table
            (dest / path.name).write_bytes(path.read_bytes())


VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "muond" / "__init__.py").read_text(),
                    re.MULTILINE).group(1)

setup(
    name="muond",
    version=VERSION,
    description="torch.optim-compatible client of the muond optimizer daemon (Muon, AdamW)",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    packages=find_packages(include=["muond", "muond.*"]),
    install_requires=["grpcio>=1.40", "protobuf>=3.20", "numpy", "torch>=1.13.0a0"],
    # Not a Python extension module: a plain shared library that muond.transport.stream_copy loads.
    ext_modules=[Extension("muond._stream_copy", sources=["muond/_stream_copy.c"],
                           extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True)],
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
)
