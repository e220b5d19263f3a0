"""Generates the Python gRPC stubs of the muond API from ``proto/``.

The stubs are never checked in: ``setup.py`` runs this at install time and CMake at build time
(``python3 python/muond/_codegen.py --proto-root proto --out build/python``). The result is the
subpackage ``muond._proto`` written under ``OUT/muond/_proto/``:

    muond_pb2.py       the calls' messages (from protoc --python_out); it imports the API's
                       other files publicly, so every message of the API is one of its names
    session_spec_pb2.py, step_pb2.py, device_transport_pb2.py, error_details_pb2.py
                       the messages of those files (one module per file of proto/muond/v1/)
    muond_pb2_grpc.py  the service stub (from the gRPC Python plugin), importing muond_pb2
    group_options.json the option table, copied from proto/muond/v1/ (muond.option_facts reads it)

Every module imports its siblings relatively, so the package works wherever it is installed.

Two toolchains are tried in order, the first that succeeds wins:

1. ``grpc_tools.protoc`` (the grpcio-tools package), when its bundled protoc understands the
   proto3 ``optional`` fields the API uses (protoc >= 3.15);
2. ``protoc`` plus ``grpc_python_plugin`` from PATH (Debian: protobuf-compiler and
   protobuf-compiler-grpc).

This file imports nothing from the ``muond`` package, so it runs before the package exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_FILE = "muond/v1/muond.proto"  # the service; it imports the other files of PROTO_DIR
PROTO_DIR = "muond/v1"
# The option table (docs/architecture.md, One table of group options), copied beside the stubs.
TABLE_FILE = "muond/v1/group_options.json"
PACKAGE_DIR = Path("muond") / "_proto"

_INIT = '"""Generated gRPC stubs of the muond.v1 API (made at build or install time)."""\n'


class CodegenError(RuntimeError):
    """No usable protoc toolchain, or protoc rejected the API."""


def _run(cmd: list[str]) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        return False, f"{cmd[0]}: {err}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _toolchains(proto_root: Path, out: Path) -> list[tuple[str, list[str]]]:
    common = [f"-I{proto_root}", f"--python_out={out}", f"--grpc_python_out={out}"]
    common += [str(path) for path in sorted((proto_root / PROTO_DIR).glob("*.proto"))]
    chains = [("grpc_tools.protoc", [sys.executable, "-m", "grpc_tools.protoc"] + common)]
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc and plugin:
        chains.append((f"{protoc} + {plugin}",
                       [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"] + common))
    return chains


def _fix_imports(module: str, name: str) -> str:
    # protoc writes `from muond.v1 import step_pb2 as ...` for an imported file, and
    # `from muond.v1.step_pb2 import *` for a public import; both would resolve against the muond
    # package itself. The modules live side by side, so they import each other relatively instead.
    fixed = re.sub(r"^from muond\.v1 import (\w+_pb2) as", r"from . import \1 as", module, flags=re.MULTILINE)
    fixed = re.sub(r"^from muond\.v1\.(\w+_pb2) import \*", r"from .\1 import *", fixed, flags=re.MULTILINE)
    if re.search(r"^(from|import) muond\.v1", fixed, flags=re.MULTILINE) or (
            name == "muond_pb2_grpc.py" and "\nfrom . import muond_pb2 as" not in fixed):
        raise CodegenError(f"unexpected import layout in the generated {name}")
    return fixed


def generate(proto_root: os.PathLike | str, out: os.PathLike | str) -> Path:
    """Writes ``OUT/muond/_proto/`` from ``PROTO_ROOT/muond/v1/*.proto``; returns that folder.

    Raises CodegenError naming every toolchain tried and why it failed.
    """
    proto_root = Path(proto_root).resolve()
    if not (proto_root / PROTO_FILE).is_file():
        raise CodegenError(f"{proto_root / PROTO_FILE} not found")
    target = Path(out).resolve() / PACKAGE_DIR
    failures = []
    with tempfile.TemporaryDirectory(prefix="muond-codegen-") as tmp:
        tmp_out = Path(tmp)
        for name, cmd in _toolchains(proto_root, tmp_out):
            ok, log = _run(cmd)
            generated = tmp_out / "muond" / "v1"
            if ok and (generated / "muond_pb2.py").is_file():
                break
            failures.append(f"{name}: {log.splitlines()[-1] if log else 'failed'}")
            shutil.rmtree(tmp_out / "muond", ignore_errors=True)
        else:
            raise CodegenError("could not generate the muond stubs; tried:\n  " + "\n  ".join(failures)
                               + "\ninstall grpcio-tools (pip) or protobuf-compiler and "
                                 "protobuf-compiler-grpc (apt)")
        target.mkdir(parents=True, exist_ok=True)
        (target / "__init__.py").write_text(_INIT)
        for module in sorted(generated.glob("*_pb2.py")) + [generated / "muond_pb2_grpc.py"]:
            (target / module.name).write_text(_fix_imports(module.read_text(), module.name))
    shutil.copyfile(proto_root / TABLE_FILE, target / Path(TABLE_FILE).name)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto-root", required=True, help="folder holding muond/v1/*.proto")
    parser.add_argument("--out", required=True, help="folder to receive muond/_proto/")
    args = parser.parse_args(argv)
    try:
        target = generate(args.proto_root, args.out)
    except CodegenError as err:
        print(f"muond codegen: {err}", file=sys.stderr)
        return 1
    print(f"muond codegen: wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
