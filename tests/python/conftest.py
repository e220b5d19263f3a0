"""pytest setup of the Python SDK tests: makes `muond` importable from this checkout and runs
the real muond daemon on loopback for the tests that need one.

The daemon binary is $MUOND_BINARY (ctest sets it) or build/muond. Without either, the daemon
tests skip, saying so; a $MUOND_BINARY that does not exist is an error. The gRPC stubs come from
PYTHONPATH (the build tree) when present, else they are generated into a temporary folder.

`daemon` is one plain daemon shared by the session; `start_daemon(*flags)` starts more, each with
its own flags (TLS, tokens, a state directory), stopped after the test. `tls_files` is a
throwaway CA with a server and a client certificate made with the `openssl` command.

`--part I/N` keeps every N-th of the selected tests from the I-th on (ctest runs each transport's
suite as N such parts, so that no part comes near its timeout and ctest spreads them over the cores).
Tests marked `slow` are collected first.
"""

import atexit
import importlib.util
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import threading
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


def _run_on_the_daemons_blas_kernels():
    """The tests' torch loads the same OpenBLAS as the daemon, which on a CPU newer than it knows
    falls back to its SSE3 kernels (docs/operations.md, OpenBLAS's kernels): the tests' own forward
    and backward passes, and their references, take the kernels the daemon runs (`muond
    --print-blas-kernel`), unless OPENBLAS_CORETYPE was given. Before anything loads OpenBLAS; the
    daemons and tools the tests start inherit the choice."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    binary = os.environ.get("MUOND_BINARY") or str(REPO_ROOT / "build" / "muond")
    if not os.path.isfile(binary):
        return  # the daemon tests skip or fail, saying why (_daemon_binary)
    try:
        kernel = subprocess.run([binary, "--print-blas-kernel"], capture_output=True, text=True, timeout=60,
                                check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return  # a binary that cannot say: OpenBLAS's own choice
    if kernel:
        os.environ["OPENBLAS_CORETYPE"] = kernel


_run_on_the_daemons_blas_kernels()


def tied_to_this_process(command):
    """The command line that runs `command` so that the kernel kills it (SIGKILL) when this test
    process dies, as a run that ctest times out or kills would: util-linux's setpriv sets
    PR_SET_PDEATHSIG, then execs the command (no Python runs between fork and exec). The signal
    follows the thread that started the child, so only children started from the main thread (which
    lives as long as the run) are tied; one started from a short-lived thread would die with it."""
    if threading.current_thread() is not threading.main_thread() or shutil.which("setpriv") is None:
        return list(command)
    return ["setpriv", "--pdeathsig", "KILL", "--", *command]


class Daemon:
    """One muond process on 127.0.0.1 with a free port (or ``listen``), stopped with SIGTERM.

    ``flags`` are added to the command line, e.g. ("--state-dir", path)."""

    def __init__(self, binary: Path, workdir: Path, flags=(), listen: str = "127.0.0.1:0"):
        self.binary = binary
        self.workdir = workdir
        self.flags = [str(f) for f in flags]
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "muond.log"
        port_file = workdir / "port"
        if port_file.exists():
            port_file.unlink()  # a restart in the same folder must not read the old port
        self._log = open(self.log_path, "ab")
        quiet = [] if "--log-level" in self.flags else ["--log-level", "warn"]
        self.proc = subprocess.Popen(
            tied_to_this_process([str(binary), "--listen", listen, "--port-file", str(port_file),
                                  "--backend", os.environ.get("MUOND_TEST_BACKEND", "cpu"), *quiet, *self.flags]),
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"muond exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"muond wrote no port file within 30 s:\n{self.log_tail()}")
            time.sleep(0.02)
        self.port = int(port_file.read_text().strip())
        self.endpoint = f"127.0.0.1:{self.port}"

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

    def kill(self) -> int:
        """SIGKILL: no shutdown, no final checkpoint (a crash)."""
        if self.proc.poll() is None:
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


@pytest.fixture
def start_daemon(tmp_path):
    """``start_daemon(*flags, listen=..., workdir=...)`` starts a daemon with extra flags and
    returns its ``Daemon``; every one started is stopped after the test. Starting again in the
    same ``workdir`` (e.g. after ``stop()``, with the same --state-dir) is a restart."""
    binary = _daemon_binary()
    started = []

    def start(*flags, listen: str = "127.0.0.1:0", workdir: Path = None) -> Daemon:
        folder = workdir or tmp_path / f"muond-{len(started)}"
        process = Daemon(binary, folder, flags, listen=listen)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def cuda_daemon(start_daemon, monkeypatch):
    """``cuda_daemon(*flags)``: a daemon on the cuda backend (device 0 unless told), which must
    offer CUDA IPC, and its ``ServerInfo``."""
    def start(*flags):
        import muond  # noqa: PLC0415 - importable once the session has started (_make_muond_importable)
        monkeypatch.setenv("MUOND_TEST_BACKEND", "cuda")
        daemon = start_daemon(*flags)
        conn = muond.Connection(daemon.endpoint)
        try:
            info = conn.server_info()
        finally:
            conn.close()
        assert info.backend == "cuda" and info.cuda_ipc, \
            f"needs a CUDA GPU and a daemon on the cuda backend: {info}"
        return daemon, info
    return start


def _openssl(*args, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stdout}")


def _issue(name: str, serial: int, subject: str, extensions: str, ca: str, cwd: Path) -> None:
    """An EC key ``name``.key and a certificate ``name``.pem signed by ``ca``.pem/.key."""
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-days", "2", "-sha256",
             "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=cwd)


def _make_ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN=muond test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=cwd)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """Paths (str) of a throwaway PKI: ``ca`` (ca.pem), ``server_cert``/``server_key`` (SAN
    IP:127.0.0.1 and DNS:localhost), ``client_cert``/``client_key`` (client auth), signed by
    ``ca``; and ``other_ca``, an unrelated CA that trusts none of them."""
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests need the openssl command (Debian: apt-get install openssl)")
    folder = tmp_path_factory.mktemp("pki")
    _make_ca("ca", folder)
    _make_ca("other_ca", folder)
    _issue("server", 1, "/CN=localhost",
           "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth", "ca", folder)
    _issue("client", 2, "/CN=muond test trainer", "extendedKeyUsage=clientAuth", "ca", folder)
    return {"ca": str(folder / "ca.pem"), "other_ca": str(folder / "other_ca.pem"),
            "server_cert": str(folder / "server.pem"), "server_key": str(folder / "server.key"),
            "client_cert": str(folder / "client.pem"), "client_key": str(folder / "client.key")}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ops: operations tests (metrics, muondctl, logs, deploy, install); ctest runs them once, "
                   "as python_ops, not per transport")
    config.addinivalue_line(
        "markers", "once: does not depend on the step transport, or names its transports itself; ctest runs "
                   "it in the python_sdk_grpc_* parts only (tests/python/CMakeLists.txt)")
    config.addinivalue_line(
        "markers", "slow: takes tens of seconds (several daemons, restarts, whole example runs); collected "
                   "first, so that parallel runs start it early rather than finish with it")


def pytest_addoption(parser):
    parser.addoption("--part", default=None, metavar="I/N",
                     help="run the I-th of N interleaved parts of the selected tests (1 ≤ I ≤ N)")


def _part(config):
    """(I, N) of ``--part I/N``, or None without it; a malformed value is a usage error."""
    value = config.getoption("--part")
    if value is None:
        return None
    try:
        index, count = (int(word) for word in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--part: expected I/N (two integers), got {value!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--part: needs 1 ≤ I ≤ N, got {value!r}")
    return index, count


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: the parts share what is left
def pytest_collection_modifyitems(config, items):
    # The slow tests first, each file's others after in their order: pytest-xdist's workers (the GPU
    # run's) then start them at once instead of ending on one of them, and the parts below each
    # take a share of them.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    part = _part(config)
    if part is None:
        return
    index, count = part
    # Interleaved, not cut into runs: the slow tests of one file (parametrized, mostly) spread over
    # the parts instead of landing in one.
    kept = items[index - 1::count]
    dropped = [item for position, item in enumerate(items) if position % count != index - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
