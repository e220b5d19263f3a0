"""pytest setup of the Python SDK tests: makes `muond` importable from this checkout and runs
the real muond daemon on loopback for the tests that need one.

The daemon binary is $MUOND_BINARY (ctest sets it) or build/muond. Without either, the daemon
tests skip, saying so; a $MUOND_BINARY that does not exist is an error. The gRPC stubs come from
PYTHONPATH (the build tree) when present, else they are generated into a temporary folder.
"""

import atexit
import importlib.util
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _make_muond_importable():
    source = str(REPO_ROOT / "python")
    if source not in sys.path:
        sys.path.insert(0, source)  # always test this checkout's package, not an installed one
    if any((Path(p or ".") / "muond" / "_proto" / "muond_pb2_grpc.py").is_file() for p in sys.path):
        return
    spec = importlib.util.spec_from_file_location("muond_codegen",
                                                  REPO_ROOT / "python" / "muond" / "_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    out = tempfile.mkdtemp(prefix="muond-test-stubs-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    codegen.generate(REPO_ROOT / "proto", out)
    sys.path.append(out)


_make_muond_importable()


class Daemon:
    """One muond process on 127.0.0.1 with a free port, stopped with SIGTERM."""

    def __init__(self, binary: Path, workdir: Path):
        self.binary = binary
        self.log_path = workdir / "muond.log"
        port_file = workdir / "port"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(binary), "--listen", "127.0.0.1:0", "--port-file", str(port_file),
             "--backend", "cpu", "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"muond exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"muond wrote no port file within 30 s:\n{self.log_tail()}")
            time.sleep(0.02)
        self.endpoint = f"127.0.0.1:{int(port_file.read_text().strip())}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _daemon_binary() -> Path:
    configured = os.environ.get("MUOND_BINARY")
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise FileNotFoundError(f"MUOND_BINARY={configured} does not exist")
        return path
    default = REPO_ROOT / "build" / "muond"
    if default.is_file():
        return default
    pytest.skip("no muond daemon binary: build it (cmake --build build) or set MUOND_BINARY")


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    process = Daemon(_daemon_binary(), tmp_path_factory.mktemp("muond"))
    yield process
    process.stop()


@pytest.fixture
def endpoint(daemon):
    """The daemon's address; afterwards, checks that the test's calls did not bring it down."""
    assert daemon.alive(), f"the daemon is down:\n{daemon.log_tail()}"
    yield daemon.endpoint
    assert daemon.alive(), f"the daemon died during the test:\n{daemon.log_tail()}"
